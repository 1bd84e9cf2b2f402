"""The cuda backend computes the attention mask in its kernel from the cells (engine/graph/forward.py
passes cell positions and sequence bits, query positions, causal limits and sequence bits):
its graphs declare no kq_mask input, so its compute buffer holds no [n_tokens, n_kv] mask, and
its tokens and logits equal the torch backend's, which reads the mask tensor. Interpreter mode
on CPU tensors, tiny models (gemma3: layer 0 sliding-window with n_swa 8, layer 1 global).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton_interp  # noqa: F401  (interpreter mode before any kernel module is imported)
from test_cuda_backend import PROMPT, cuda_ops, models  # noqa: F401  (the module-scoped fixture)
from test_kernels import rel_err

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.context.reserve import plan_sizes
from ubatch.engine.graph.forward import SEQ_BITS, mask_in_kernel
from ubatch.engine.params import ContextParams, derive
from ubatch.kernels import backends
from ubatch.kernels.ops import MaskCells
from ubatch.kernels.torch_ops import mask_from_cells


def two_sequences(ctx: Context, steps: int, forced: list[list[int]] | None = None) -> tuple[list, torch.Tensor]:
    """Prompts of 10 and 7 tokens in one batch (the window of 8 slides inside the first), then
    `steps` greedy decodes of both sequences in one ubatch each."""
    a, b = PROMPT, PROMPT[3:]
    ctx.decode(Batch(a + b, [*range(len(a)), *range(len(b))], [[0]] * len(a) + [[1]] * len(b), [True] * 17))
    rows, toks, pos = [ctx.logits.clone()], [], [len(a), len(b)]
    for i in range(steps):
        toks.append([int(ctx.logits[r].argmax()) for r in (-2, -1)])
        nxt = forced[i] if forced else toks[-1]
        ctx.decode(Batch(nxt, [pos[0] + i, pos[1] + i], [[0], [1]], [True, True]))
        rows.append(ctx.logits.clone())
    return toks, torch.cat(rows)


@pytest.mark.parametrize("arch, unified", [("llama", True), ("gemma3", False)])
def test_two_sequences_with_the_mask_in_the_kernel_equal_the_torch_backend(models, arch: str, unified: bool) -> None:  # noqa: F811
    params = ContextParams(n_ctx=512, n_ubatch=16, n_seq_max=2, kv_unified=unified)
    want_toks, want = two_sequences(Context(models[arch], params, backends.create("torch")), 2)
    ctx = Context(models[arch], params, cuda_ops())
    toks, got = two_sequences(ctx, 2, want_toks)
    assert toks == want_toks
    assert rel_err(got, want) <= 1e-4
    assert mask_in_kernel(ctx.ops, ctx.memory)
    for g in ctx._graphs.values():  # every graph the context ran: cells in, no mask tensor
        assert not [k for k in g.inputs if k.startswith("kq_mask")]
        assert {"inp_q_pos", "inp_q_lim", "inp_q_seq", "kv_pos_0", "kv_seq_0"} <= set(g.inputs)


def test_the_planned_compute_buffer_of_a_cuda_context_has_no_mask(models) -> None:  # noqa: F811
    """Planned from shapes only (nothing allocated): the torch plan's largest tensor is the
    [n_ubatch, n_kv] f16 mask; the cuda plan has none and is smaller by about that much."""
    cp = derive(ContextParams(n_ctx=4096, n_ubatch=512), models["gemma3"].hparams)
    plans = {}
    for name in ("torch", "cuda"):
        _, r, sizes = plan_sizes(models["gemma3"], cp, backends.create(name))
        plans[name] = (r, sizes)
    torch_peak = {n: b for n, _, b in plans["torch"][0].peak}
    assert torch_peak["kq_mask_0"] == 512 * 4096 * 2
    assert not [n for n, _, _ in plans["cuda"][0].peak if "kq_mask" in n]
    assert plans["cuda"][1].compute <= plans["torch"][1].compute - 512 * 4096 * 2


def test_without_causal_attention_the_kernel_sees_later_tokens(models) -> None:  # noqa: F811
    """attention.causal = false: each query's causal limit is past every cell."""
    params = ContextParams(n_ctx=256, n_ubatch=16, causal_attn=False)
    out = {}
    for name in ("torch", "cuda"):
        ctx = Context(models["gemma3"], params, cuda_ops() if name == "cuda" else backends.create(name))
        ctx.decode(Batch.from_tokens(PROMPT, 0, all_logits=True))
        out[name] = ctx.logits.clone()
    assert rel_err(out["cuda"], out["torch"]) <= 1e-4


def test_a_cache_type_the_kernel_does_not_read_takes_the_reference_with_the_cells_mask(models) -> None:  # noqa: F811
    """A q4_0 cache: the torch reference attention, its mask built from the same cell inputs."""
    params = ContextParams(n_ctx=256, n_ubatch=16, type_k="q4_0", type_v="q4_0")
    out = {}
    for name in ("torch", "cuda"):
        ctx = Context(models["gemma3"], params, cuda_ops() if name == "cuda" else backends.create(name))
        ctx.decode(Batch.from_tokens(PROMPT, 0, all_logits=True))
        ctx.decode(Batch.from_tokens([7], len(PROMPT)))
        out[name] = ctx.logits.clone()
    assert rel_err(out["cuda"], out["torch"]) <= 1e-4


def test_mask_from_cells_is_the_engine_mask_rules() -> None:
    rng = np.random.default_rng(3)
    g, t, n_kv, n_swa = 2, 5, 256, 8
    pos = rng.integers(-1, 40, size=(g, n_kv))
    seqs = rng.random((g, n_kv, 3)) < 0.5
    qpos, qseq = rng.integers(0, 40, size=(g, t)), rng.integers(0, 3, size=(g, t))
    want = (pos[:, None, :] >= 0) & (pos[:, None, :] <= qpos[..., None]) & (qpos[..., None] - pos[:, None, :] < n_swa)
    want &= np.take_along_axis(seqs, qseq[:, None, :].repeat(n_kv, 1), 2).transpose(0, 2, 1)
    bits = (seqs * (1 << np.arange(3))).sum(2)
    cells = MaskCells(
        torch.from_numpy(pos).int(),
        torch.from_numpy(bits).long(),
        torch.from_numpy(qpos.ravel()).int(),
        torch.from_numpy(1 << qseq.ravel()).long(),
        n_swa,
        torch.from_numpy(qpos.ravel()).int(),
    )
    got = mask_from_cells(t, cells)
    assert got.dtype == torch.float16 and got.shape == (g, t, n_kv)
    assert torch.equal(got == 0, torch.from_numpy(want)) and bool((got[~torch.from_numpy(want)] == -np.inf).all())


def test_more_sequences_than_bits_keep_the_mask_tensor(models) -> None:  # noqa: F811
    from ubatch.engine.kv.memory import KVMemory

    cp = derive(
        ContextParams(n_ctx=SEQ_BITS * 256 * 2, n_seq_max=SEQ_BITS + 1, kv_unified=True), models["llama"].hparams
    )
    assert not mask_in_kernel(cuda_ops(), KVMemory.build(models["llama"].hparams, cp, sizes_only=True))


def test_a_split_decode_writes_its_partials_into_the_planned_scratch(models, monkeypatch) -> None:  # noqa: F811
    """The GPU's choices in the interpreter (decode tiles, the cells split 2 ways): the attention
    node's planned scratch is exactly the split partials, and the logits equal the reference."""
    from types import SimpleNamespace

    from ubatch.kernels.cuda.triton import attention as ta

    monkeypatch.setattr(ta, "mode", SimpleNamespace(interpreted=lambda: False))
    params = ContextParams(n_ctx=256, n_ubatch=16)
    out = {}
    for name in ("torch", "cuda"):
        ctx = Context(models["llama"], params, cuda_ops() if name == "cuda" else backends.create(name))
        ctx.decode(Batch.from_tokens(PROMPT, 0))
        ctx.decode(Batch.from_tokens([7], len(PROMPT)))
        out[name] = ctx.logits.clone()
        if name == "cuda":
            (shape,) = [s for s in ctx._graphs if s.n_tokens == 1]
            node = next(n for n in ctx._graphs[shape].nodes if n.op == "attention")
            hp = models["llama"].hparams
            n = ta.partials(1, 1, hp.n_head, hp.n_embd_head_k, hp.n_head_kv, 256, hp.n_embd_head_v, False)
            assert n > 0 and node.scratch == [((n,), torch.float32)]
    assert rel_err(out["cuda"], out["torch"]) <= 1e-4
