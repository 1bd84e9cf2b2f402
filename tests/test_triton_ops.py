"""The Triton kernels other than the matmul (kernels/cuda/triton/elementwise.py, gather.py,
attention.py) against the torch reference, in Triton's interpreter on tiny shapes.

Tolerances: element-wise ops and norms <= 1e-6 relative to the largest reference value (f32
arithmetic in another order); the gathers and the cache writes bit-exact (Q8_0 rows hold the
bytes ggml's reference quantiser writes); attention <= 1e-5 (online softmax in tiles of 64 cells
vs the reference's 256). The sm_90 compile of every COMPILE_SPECS entry is
scripts/triton_compile_check.py's job (tests/test_triton_matmul.py runs it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton_interp  # noqa: F401  (sets TRITON_INTERPRET before any kernel module is imported)
from gguf import GGMLQuantizationType as T
from test_kernels import rel_err, weight

from ubatch.kernels.cuda.triton import mode
from ubatch.kernels.ops import KV_CHUNK, AttentionArgs, KVTensor, LoraArgs, MaskCells, attn_scratch
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.quantize import QUANTIZERS
from ubatch.kernels.torch_ops import TorchOps

mode.use_interpreter_without_gpu()
from ubatch.kernels.cuda.triton import attention as ta  # noqa: E402
from ubatch.kernels.cuda.triton import elementwise as te  # noqa: E402
from ubatch.kernels.cuda.triton import gather as tg  # noqa: E402

REF = TorchOps()
GEN = torch.Generator().manual_seed(0)


def randn(*shape: int, s: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN) * s


def test_rms_norm_plain_and_fused_with_the_residual_add() -> None:
    x, w, res = randn(5, 3, 48, s=100), randn(48), randn(5, 3, 48)
    want = REF.rms_norm(x, w, 1e-6, torch.empty_like(x), [torch.empty(5, 3, 1)])
    assert rel_err(te.rms_norm(x, w, 1e-6, torch.empty_like(x)), want) <= 1e-6
    out, s = torch.empty_like(x), torch.empty_like(x)
    te.rms_norm(x, w, 1e-6, out, res, s)
    assert rel_err(out, want) <= 1e-6 and rel_err(s, res + want) <= 1e-6


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
def test_rope_rotates_n_rot_dims_and_copies_the_rest(neox: bool) -> None:
    x = randn(5, 3, 64)
    cos, sin = REF.rope_cache(torch.tensor([0, 7, 300, 4095, 12]), 48, 10000.0, 1.0)
    want = REF.rope(x, cos, sin, neox, torch.empty_like(x))
    got = te.rope(x, cos.contiguous(), sin.contiguous(), neox, torch.empty_like(x))
    assert rel_err(got, want) <= 1e-6


def test_glu_scale_add_softcap_rows() -> None:
    g, u = randn(3, 1500, s=4), randn(3, 1500)  # two programs, the second partial
    for act in ("gelu_tanh", "silu"):
        want = REF.glu(g, u, act, torch.empty_like(g))
        assert rel_err(te.glu(g, u, act, torch.empty_like(g)), want) <= 1e-6, act
    assert torch.equal(te.elementwise(te.OP_ADD, g, u, 0.0, torch.empty_like(g)), g + u)
    assert torch.equal(te.elementwise(te.OP_SCALE, g, None, 0.25, torch.empty_like(g)), g * 0.25)
    want = REF.softcap(g * 10, 30.0, torch.empty_like(g))
    assert rel_err(te.elementwise(te.OP_SOFTCAP, g * 10, None, 30.0, torch.empty_like(g)), want) <= 1e-6
    b = torch.randn(g.shape[-1])
    assert torch.equal(te.elementwise(te.OP_BIAS, g, b, 0.0, torch.empty_like(g)), g + b)
    idx = torch.tensor([2, 0, 2])
    assert torch.equal(tg.rows(g, idx, torch.empty(3, 1500)), g[idx])


@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_get_rows_is_bit_exact(t: T) -> None:
    w = weight(t, 20, 96)
    ids = torch.tensor([3, 0, 19, 3, 17])
    out = tg.get_rows(w, ids, torch.empty(5, 96))
    want = dequantize(w.raw, t, w.shape)[ids]
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("kv_type", ["f32", "f16", "bf16", "q8_0"])
def test_kv_store_writes_the_bytes_the_reference_writes(kv_type: str) -> None:
    x = randn(4, 2, 64)
    x[1, 0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[2, 1, 5] = 0.5 * x[2, 1].abs().max() / 127 * 127  # something near a rounding half
    cells = torch.tensor([5, 0, 9, 2])
    if kv_type == "q8_0":
        a, b, gt = torch.zeros(10, 136, dtype=torch.uint8), torch.zeros(10, 136, dtype=torch.uint8), int(T.Q8_0)
    else:
        dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kv_type]
        a, b, gt = torch.zeros(10, 2, 64, dtype=dt), torch.zeros(10, 2, 64, dtype=dt), {
            "f32": int(T.F32), "f16": int(T.F16), "bf16": int(T.BF16)}[kv_type]  # fmt: skip
    REF.kv_store(KVTensor(a, gt, 2, 64), cells, x)
    tg.kv_store(b, gt, cells, x)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _kv(kv_type: str, rows: torch.Tensor) -> KVTensor:
    n, hkv, d = rows.shape
    if kv_type == "q8_0":
        return KVTensor(QUANTIZERS[int(T.Q8_0)](rows.reshape(n, -1)), int(T.Q8_0), hkv, d)
    dt, gt = (torch.float32, T.F32) if kv_type == "f32" else (torch.float16, T.F16)
    return KVTensor(rows.to(dt), int(gt), hkv, d)


def _cells_mask(pos: np.ndarray, seqs: np.ndarray, qpos: np.ndarray, qseq: np.ndarray, n_swa: int) -> np.ndarray:
    """The four rules as engine/kv/cache.py KVCache.mask states them, per group: (T, n_kv) bool."""
    vis = (pos[None, :] >= 0) & seqs[:, qseq].T & (pos[None, :] <= qpos[:, None])
    return vis & ~((qpos[:, None] - pos[None, :] >= n_swa) if n_swa > 0 else False)


@pytest.mark.parametrize(
    "kv_type, t, heads",
    [("f32", 5, (4, 2)), ("f16", 1, (4, 2)), ("f16", 5, (4, 1)), ("q8_0", 1, (4, 1)), ("q8_0", 5, (4, 2))],
    ids=["f32-5-gqa", "f16-1-gqa", "f16-5-mqa", "q8_0-1-mqa", "q8_0-5-gqa"],
)
def test_attention_matches_the_reference_with_the_mask_tensor_or_the_cells(
    kv_type: str, t: int, heads: tuple[int, int]
) -> None:
    """Two groups (streams) reading their own cells; the mask either as the engine's tensor or
    computed in the kernel from cell positions, sequence sets and a window: same output."""
    h, hkv, d, g, n_kv, size, n_swa = *heads, 32, 2, 512, 640, 200
    rng = np.random.default_rng(t)
    k, v = _kv(kv_type, randn(g * size, hkv, d)), _kv(kv_type, randn(g * size, hkv, d))
    q = randn(g, t, h, d)
    pos = rng.integers(-1, 300, size=(g, n_kv)).astype(np.int32)  # -1: empty cells
    pos[:, 300:] = -1  # the second chunk empty for everyone: skipped through `visible`
    seqs = rng.random((g, n_kv, 3)) < 0.6  # three sequences share the cells
    qpos = rng.integers(250, 300, size=(g, t)).astype(np.int32)
    qseq = rng.integers(0, 3, size=(g, t))
    pos[:, 0], seqs[:, 0] = 250, True  # every query sees something
    vis = np.stack([_cells_mask(pos[i], seqs[i], qpos[i], qseq[i], n_swa) for i in range(g)])
    mask = torch.from_numpy(np.where(vis, 0.0, -np.inf).astype(np.float16))
    starts = torch.tensor([0, size])
    visible = torch.from_numpy(vis.reshape(g * t, n_kv // KV_CHUNK, KV_CHUNK).any(2).any(0))
    out = torch.empty(g * t, h * d)
    scratch = [torch.empty(s, dtype=dt) for s, dt in attn_scratch(g, t, h, hkv, n_kv, d, d)]
    a = AttentionArgs(q, k, v, starts, n_kv, mask, 0.125, visible)
    want = REF.attention(a, out.clone(), scratch)
    tiles = ta.blocks(t * (h // hkv), d)  # the GPU's tiles (the interpreter's default is one chunk wide)
    got = ta.attention(a, torch.empty_like(out), tiles=tiles)
    assert rel_err(got, want) <= 1e-5
    if t == 1:  # decode: the cells split 4 ways (one split sees only empty cells), then combined
        got = ta.attention(a, torch.empty_like(out), tiles=tiles, split=4)
        assert rel_err(got, want) <= 1e-5
    bits = (seqs.astype(np.int64) << np.arange(3)).sum(2)
    qp = torch.from_numpy(qpos.reshape(-1))  # causal: each query's limit is its own position
    cells = MaskCells(
        torch.from_numpy(pos), torch.from_numpy(bits), qp, torch.from_numpy(np.int64(1) << qseq.reshape(-1)), n_swa, qp
    )
    got = ta.attention(AttentionArgs(q, k, v, starts, n_kv, None, 0.125, visible, cells), torch.empty_like(out))
    assert rel_err(got, want) <= 1e-5  # one-chunk tiles
    if kv_type == "f16":  # gemma2's soft-capped scores (c·tanh(s / c), then the scale), in the kernel
        a = AttentionArgs(q * 4, k, v, starts, n_kv, mask, 0.125, visible, softcap=5.0)
        want = REF.attention(a, out.clone(), scratch)
        assert rel_err(ta.attention(a, torch.empty_like(out), tiles=tiles), want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("n", "ranks", "m"), [(1, [16], 1), (5, [8, 16, 4, 0], 1), (6, [4, 40, 16], 2)])
def test_lora_segmented_matches_the_per_row_definition(dtype: torch.dtype, n: int, ranks: list[int], m: int) -> None:
    """triton/lora.py: mixed adapters, ranks and slots in one launch (two column programs, the
    second partial; x in two BLOCK_K steps), in place and not, and with `sel`."""
    from test_lora_kernel import check, make_stack, per_row, rows_of

    from ubatch.kernels.cuda.triton import lora as tl_lora

    w = make_stack(ranks, 200, 150, dtype, seed=n)
    x, y = randn(n, 200), randn(n, 150)
    idx, scale = rows_of(n, m, len(ranks), seed=n)
    want = per_row(y, x, w, idx, scale)
    a = LoraArgs(y.clone(), x, w, idx, scale)
    assert tl_lora.supported(a, a.y)
    check(tl_lora.lora(a, torch.empty_like(y)), y, want)
    check(tl_lora.lora(a, a.y), y, want)
    sel = torch.tensor([n - 1, 0], dtype=torch.int64)
    xs, ys = x[: len(sel)].clone(), y[: len(sel)].clone()
    got = tl_lora.lora(LoraArgs(ys.clone(), xs, w, idx, scale, sel), torch.empty_like(ys))
    check(got, ys, per_row(ys, xs, w, idx[sel], scale[sel]))


def test_lora_segmented_row_is_the_same_alone_and_among_others() -> None:
    from test_lora_kernel import make_stack, rows_of

    from ubatch.kernels.cuda.triton import lora as tl_lora

    w = make_stack([16, 8, 32], 96, 130, torch.float16)
    x0, y0 = randn(1, 96), randn(1, 130)
    outs = []
    for n in (1, 7):
        x, y = torch.cat([x0, randn(n - 1, 96)]), torch.cat([y0, randn(n - 1, 130)])
        idx, scale = rows_of(n, 1, 3, seed=n)
        idx[0, 0], scale[0, 0] = 2, 0.7
        outs.append(tl_lora.lora(LoraArgs(y, x, w, idx, scale), torch.empty_like(y))[0])
    assert torch.equal(outs[0], outs[1])
