"""The forward pass on tiny random GGUF models against an independent, cache-free reference.

The reference (tests/embd_reference.py, written straight from reference/gguf-models.md §3:
full-sequence attention with explicit causal / sliding-window masks, no KV cache, no ubatches)
checks the engine's cache placement, mask, RoPE bases, norms and quant paths all at once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from embd_reference import reference_hidden
from gguf import GGMLQuantizationType as T
from tiny_models import TinySpec, write_tiny_model

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams


def reference_logits(m: Model, ids: list[int]) -> torch.Tensor:
    """The output head over the reference's final-norm hidden states (causal, from position 0)."""
    return reference_hidden(m, ids) @ m.output.dense().T


def all_logits(m: Model, ids: list[int], **kw: int | str) -> torch.Tensor:
    ctx = Context(m, ContextParams(**{"n_ctx": 256, "type_k": "f32", "type_v": "f32", **kw}))
    ctx.decode(Batch.from_tokens(ids, 0, all_logits=True))
    return ctx.logits


IDS = [2] + list(range(40, 70)) + list(range(100, 120))  # 51 tokens: beyond the tiny 8-token window


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_prefill_matches_reference(arch: str, tiny_gemma_model, tiny_llama_model) -> None:
    m = tiny_gemma_model if arch == "gemma3" else tiny_llama_model
    ours = all_logits(m, IDS)
    ref = reference_logits(m, IDS)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_k_quant_model_matches_reference(tmp_path) -> None:
    spec = TinySpec(
        arch="llama",
        n_embd=256,
        n_ff=512,
        head_dim=64,
        n_head=4,
        n_head_kv=1,
        n_layer=3,
        matrix_types=(T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.BF16),
        embd_type=T.Q6_K,
    )
    m = Model.load(write_tiny_model(tmp_path / "k.gguf", spec))
    torch.testing.assert_close(all_logits(m, IDS[:20]), reference_logits(m, IDS[:20]), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("n_ubatch", [1, 7, 16])
def test_ubatch_size_does_not_change_logits(tiny_gemma_model, n_ubatch: int) -> None:
    m = tiny_gemma_model
    torch.testing.assert_close(all_logits(m, IDS, n_ubatch=n_ubatch), all_logits(m, IDS), atol=1e-4, rtol=1e-4)


def test_token_by_token_decode_matches_prefill(tiny_gemma_model) -> None:
    """The KV cache path (one token per decode, SWA cells being reused) equals one prefill."""
    m = tiny_gemma_model
    full = all_logits(m, IDS)
    ctx = Context(m, ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    rows = []
    for p, t in enumerate(IDS):
        ctx.decode(Batch.from_tokens([t], p))
        rows.append(ctx.logits[-1].clone())  # logits are valid until the next decode
    torch.testing.assert_close(torch.stack(rows), full, atol=1e-4, rtol=1e-4)


def test_swa_cache_wraps_and_reuses_cells_outside_the_window(tiny_gemma_model) -> None:
    """300 tokens through a 256-cell SWA cache (window 8): cells left behind the window are
    overwritten, the global cache keeps everything, and the logits still equal the reference."""
    m = tiny_gemma_model
    ids = [2] + [int(x) for x in np.random.default_rng(1).integers(7, 326, 299)]
    ctx = Context(m, ContextParams(n_ctx=512, n_ubatch=16, type_k="f32", type_v="f32"))
    base, swa = ctx.memory.caches
    assert (base.size, swa.size) == (512, 256)  # round_up(min(512, n_swa 8 + n_ubatch 16), 256)
    ctx.decode(Batch.from_tokens(ids, 0, all_logits=True))
    assert base.used == 300 and swa.used == 256
    assert swa.seq_pos_min(0) > 0 and base.seq_pos_min(0) == 0
    torch.testing.assert_close(ctx.logits, reference_logits(m, ids), atol=2e-4, rtol=1e-4)


def test_sequences_sharing_a_ubatch_stay_apart(tiny_gemma_model) -> None:
    """Two sequences interleaved in one batch give the logits each gives alone: the mask works."""
    m = tiny_gemma_model
    a, b = IDS[:20], [2] + list(range(200, 219))
    alone_a, alone_b = all_logits(m, a), all_logits(m, b)
    ctx = Context(m, ContextParams(n_ctx=256, n_seq_max=2, kv_unified=True, type_k="f32", type_v="f32"))
    batch = Batch()
    for p in range(20):  # interleave rows: a0 b0 a1 b1 ...
        batch.add(a[p], p, 0, True)
        batch.add(b[p], p, 1, True)
    ctx.decode(batch)
    torch.testing.assert_close(ctx.logits[0::2], alone_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ctx.logits[1::2], alone_b, atol=1e-4, rtol=1e-4)


def test_f16_cache_is_close_to_f32(tiny_gemma_model) -> None:
    m = tiny_gemma_model
    f16 = all_logits(m, IDS, type_k="f16", type_v="f16")
    f32 = all_logits(m, IDS)
    assert (f16 - f32).abs().max() < 0.05


def test_only_output_rows_get_logits(tiny_gemma_model) -> None:
    m = tiny_gemma_model
    ctx = Context(m, ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    ctx.decode(Batch.from_tokens(IDS, 0))
    assert ctx.logits.shape == (1, m.hparams.n_vocab)
    torch.testing.assert_close(ctx.logits[0], all_logits(m, IDS)[-1], atol=1e-4, rtol=1e-4)
