"""Every registered backend computes the same matmuls and lookups as dequantise-then-matmul.

Random blocks of every type with a kernel, real tensors of the default model, the row counts
that select each path (1 and 3: GEMV tiles, 16: the last GEMV size, 512: the C GEMM on AVX2,
dequantised tiles + BLAS on the portable build), the GEMM's block edges, odd column counts for
the float types. Tolerance: max |error| / max |reference| <= 1e-5, where the AVX2 build's
block-type products read x as 16-bit integers (csrc/quant_i16.h) against x rounded the same way,
and that rounding is checked on its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_dequant import F16_FIELDS, random_rows

from ubatch.kernels import backends
from ubatch.kernels.cpu.bind import ATTN_MAX_ROWS, GEMV_MAX_ROWS, IQ_X16_TYPES
from ubatch.kernels.cpu.ops import IQ_TYPES, KERNEL_TYPES, CpuOps
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.weight import QWeight

# the cuda backend has its own tests (test_triton_*.py, test_cuda_backend.py, scripts/gpu_check.sh)
BACKENDS = [b for b in backends.names() if b not in ("auto", "cuda")]
QUANT = [t for t in F16_FIELDS if int(t) in KERNEL_TYPES]
FLOATS = [T.F32, T.F16, T.BF16]
ROWS = [1, 3, 16, 512]


def float_rows(t: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if t == T.F32:
        return x.view(np.uint8)
    if t == T.F16:
        return x.astype(np.float16).view(np.uint8)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bf16 by truncation


def weight(t: T, n: int, k: int, seed: int = 0) -> QWeight:
    block, _ = GGML_QUANT_SIZES[t]
    raw = float_rows(t, n, k, seed) if t in FLOATS else random_rows(t, n, k // block, seed)
    return QWeight(f"w_{t.name}", torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1), int(t), (n, k))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def x16_round(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the integer products read it: per block of 32 values (AVX2) or 256 (the AVX-512
    GEMV of the K-quants), the nearest multiple (ties to even) of max|x| / 32767, every step in
    f32 as csrc/quant_i16.h and csrc/gemv_vnni.c compute it."""
    v = x.float().reshape(x.shape[0], -1, block)
    amax = v.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
    return (torch.round(v * inv).double() * (amax / 32767.0).double()).reshape(x.shape)


def reads_x16(ops, t: T, m: int = 1) -> bool:
    """Does this backend multiply t's codes with x as 16-bit integers (the AVX2 build) for m rows?
    The IQ types' GEMM reads x in f32, and so does the GEMV of all but the table types."""
    x16 = int(t) in KERNEL_TYPES and (int(t) not in IQ_TYPES or (int(t) in IQ_X16_TYPES and m <= GEMV_MAX_ROWS))
    return isinstance(ops, CpuOps) and ops.kernels.x16 and t not in FLOATS and x16


def reference(ops, w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """Dequantise then matmul in f64, with x as the backend reads it."""
    t = T(w.ggml_type)
    xr = x16_round(x) if reads_x16(ops, t, x.shape[0]) else x.double()
    return xr @ dequantize(w.raw, t, w.shape).double().t()


def run_linear(ops, w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """The op as a graph runs it: output and any scratch the backend asks for, preallocated."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    scratch = [torch.empty(s, dtype=d) for s, d in ops.linear_scratch(x.shape[0], w)]
    ops.prepare_weights([w])
    return ops.linear(x, w, out, scratch)


@pytest.fixture(scope="module", params=BACKENDS)
def ops(request):
    return backends.create(request.param, n_threads=2)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("t", QUANT + FLOATS, ids=lambda t: t.name)
def test_linear_matches_dequantise_then_matmul(ops, t: T, m: int) -> None:
    k = 512 if GGML_QUANT_SIZES[t][0] == 256 else 160
    w = weight(t, 200, k, seed=m)  # 200 rows: several GEMM tiles when m > 64
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    assert rel_err(run_linear(ops, w, x), reference(ops, w, x)) <= 1e-5


@pytest.mark.parametrize("m", [1, 5, 8, 16])
@pytest.mark.parametrize("nc", [1, 2, 3, 4, 6, 7])
@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_1], ids=lambda t: t.name)
def test_gemv_every_chunk_count(ops, t: T, nc: int, m: int) -> None:
    """The AVX2 GEMV takes Q8_0/Q4_0/Q4_1 chunks four at a time, then in pairs, then one (Q5_1:
    pairs): every remainder of the chunk count, at one row, a partial tile, a full tile of 8 and
    two tiles."""
    w = weight(t, 37, 32 * nc, seed=nc)
    x = torch.randn(m, 32 * nc, generator=torch.Generator().manual_seed(m))
    got = run_linear(ops, w, x)
    assert rel_err(got, reference(ops, w, x)) <= 1e-5
    if isinstance(ops, CpuOps):  # the C kernels: a row's bits whatever rows share its call
        assert torch.equal(got[:1], run_linear(ops, w, x[:1]))


def test_x16_rounding_is_within_its_bound_and_is_what_the_kernels_multiply() -> None:
    """The 16-bit x of the AVX2 build: each value within half a step (max|x| / 65534) of its
    32-value chunk's largest, and a product against it nearer the rounded x than the f32 one
    (outliers of 1000 in a few chunks, as hidden states have)."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    x[:, 7], x[2, 100] = 1000.0, -333.0
    xr = x16_round(x)
    step = x.abs().reshape(4, -1, 32).amax(-1, keepdim=True).double() / 32767
    assert ((xr - x.double()).reshape(4, -1, 32).abs() <= step / 2 * (1 + 1e-6)).all()
    assert not torch.equal(xr, x.double())
    ops = CpuOps(2, no_avx512=True)
    assert ops.kernels.x16 == (ops.kernels.library.simd == "avx2")
    if not ops.kernels.x16:
        pytest.skip("no AVX2 build here")
    w = weight(T.Q8_0, 64, 256)
    dense = dequantize(w.raw, T.Q8_0, w.shape).double()
    for xs in (x[:1], x.repeat(10, 1)):  # the GEMV and the GEMM
        got = run_linear(ops, w, xs)
        assert rel_err(got, x16_round(xs) @ dense.t()) <= 1e-6
        assert rel_err(got, xs.double() @ dense.t()) > 1e-6


@pytest.mark.parametrize("t", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_the_avx512_k_quant_gemv_reads_x_as_exactly_as_f32(t: T) -> None:
    """The AVX-512 build's K-quant GEMV (csrc/gemv_vnni.c) multiplies the codes with x as two
    planes of 16-bit integers, one scale per 256 values: with outliers of 1000 in a super-block
    (as hidden states have) its result is dequantise-then-matmul of x itself to 1e-6 (one plane
    was ~1e-4 off here), as close as the f32 GEMM of more rows, and the rows of one call get the
    bits of one-row calls at every tile size."""
    ops = CpuOps(2)
    if not ops.kernels.vnni:
        pytest.skip("no AVX-512 BW build here")
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(5))
    x[:, 7], x[2, 300] = 1000.0, -333.0
    w = weight(t, 48, 512, seed=2)
    dense = dequantize(w.raw, t, w.shape).double()
    for m in (1, 8, 9, 16):
        got = run_linear(ops, w, x[:m])
        assert rel_err(got, x[:m].double() @ dense.t()) <= 1e-6
        assert torch.equal(got[m - 1 :], run_linear(ops, w, x[m - 1 : m]))
    gemm = run_linear(ops, w, x.repeat(3, 1))[:16]
    assert rel_err(gemm, run_linear(ops, w, x)) <= 2e-6


@pytest.mark.parametrize("t", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_the_avx512_k_quant_gemm_reads_x_nearly_as_f32_and_rows_alone(t: T) -> None:
    """The AVX-512 build's K-quant GEMM (csrc/gemv_vnni.c, more rows than the GEMV takes) reads x
    as 16 + 8 bits a value: with outliers of 1000 its result is dequantise-then-matmul of x
    itself to 2e-6, the GEMV's bound against the GEMM (16 bits alone: 2-4e-5 without outliers), and a row's bits are the same in calls of 17, 40 and
    100 rows (partial row strips, a partial last panel of weight rows, three super-blocks). AMX
    tiles are left out: on a CPU with them, 64 rows and more would take the tile GEMM instead."""
    ops = CpuOps(2, no_amx=True)
    if not ops.kernels.vnni:
        pytest.skip("no AVX-512 BW build here")
    x = torch.randn(100, 768, generator=torch.Generator().manual_seed(7))
    x[:, 7], x[2, 300] = 1000.0, -333.0
    w = weight(t, 77, 768, seed=3)
    got = run_linear(ops, w, x)
    assert rel_err(got, x.double() @ dequantize(w.raw, t, w.shape).double().t()) <= 2e-6
    for m in (17, 40):
        assert torch.equal(run_linear(ops, w, x[100 - m :]), got[100 - m :])


@pytest.mark.parametrize("k", [33, 67, 1])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("t", FLOATS, ids=lambda t: t.name)
def test_float_weights_with_odd_column_counts(ops, t: T, m: int, k: int) -> None:
    w = weight(t, 37, k)
    x = torch.randn(m, k)
    want = x.double() @ dequantize(w.raw, t, w.shape).double().t()
    assert rel_err(run_linear(ops, w, x), want) <= 1e-5


@pytest.mark.parametrize("m,n,k", [(17, 16, 32), (23, 65, 288), (100, 130, 800)])
@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_1, T.F16], ids=lambda t: t.name)
def test_gemm_block_edges(ops, t: T, m: int, n: int, k: int) -> None:
    """Prefill shapes across the GEMM's blocking: partial row strips, partial weight panels and
    blocks, k spanning several slices with a short last one (and an odd k for F16)."""
    k += t == T.F16
    block, _ = GGML_QUANT_SIZES[t]
    w = weight(t, n, k // block * block if t != T.F16 else k, seed=n)
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(k))
    assert rel_err(run_linear(ops, w, x), reference(ops, w, x)) <= 1e-5


def test_strided_activations_and_output_rows(ops) -> None:
    """x may be a row slice of a wider buffer (ldx > k), as a view of the workspace is."""
    w = weight(T.Q8_0, 64, 96)
    big = torch.randn(4, 200)
    x = big[:, 8:104]
    assert rel_err(run_linear(ops, w, x), reference(ops, w, x)) <= 1e-5


@pytest.mark.parametrize("t", QUANT + FLOATS, ids=lambda t: t.name)
def test_get_rows_is_bit_exact(ops, t: T) -> None:
    k = 512 if GGML_QUANT_SIZES[t][0] == 256 else 96
    w = weight(t, 50, k)
    ids = torch.tensor([3, 0, 49, 3, 17] * 3)
    out = torch.empty(len(ids), k)
    ops.prepare_weights([w])
    ops.get_rows(w, ids, out)
    want = dequantize(w.raw, t, w.shape)[ids]
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("t", QUANT + FLOATS, ids=lambda t: t.name)
def test_prefill_tiles_are_bit_exact_dequantisation(t: T, portable: bool) -> None:
    """The scratch tiles the GEMM reads hold exactly gguf's dequantised values."""
    k = 256 if GGML_QUANT_SIZES[t][0] == 256 else 64
    w = weight(t, 70, k)
    tile = torch.empty(70, k)
    CpuOps(2, portable).kernels.dequant_rows(w, 0, 70, tile)
    want = dequantize(w.raw, t, w.shape)
    assert torch.equal(tile.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("backend", ["cpu", "cpu-avx2", "cpu-portable"])
@pytest.mark.parametrize("t", QUANT + FLOATS, ids=lambda t: t.name)
def test_gemm_panel_spans_are_bit_exact_dequantisation(t: T, backend: str) -> None:
    """ub_dequant_span, what the GEMM packs its panels from: spans of whole chunks starting inside
    a row or ending short of it (a K-quant span shares its super-block's scales across chunks)."""
    import ctypes

    k = 768
    w = weight(t, 5, k)
    lib = backends.create(backend, n_threads=1).kernels.lib
    lib.ub_dequant_span.argtypes = [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    want = dequantize(w.raw, t, w.shape)
    for r, (k0, n) in enumerate([(0, k), (256, 256), (512, 224), (96, 512), (704, 64)]):
        out = torch.zeros(n)
        lib.ub_dequant_span(int(t), w.raw.data_ptr() + r * w.row_bytes, k0, n, k, out.data_ptr())
        assert torch.equal(out.view(torch.int32), want[r, k0 : k0 + n].view(torch.int32)), (k0, n)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_v.weight",
        "blk.0.attn_output.weight",
        "blk.0.ffn_down.weight",
        "blk.3.ffn_down.weight",
    ],
)
def test_real_tensors_of_the_default_model(default_model, ops, name: str) -> None:
    """Q8_0 (the tied output head), Q5_0, Q4_K and Q6_K exactly as the file stores them."""
    info = default_model.gguf.tensors[name]
    w = next(x for x in default_model.matrices() if x.name == name)
    assert w.ggml_type == info.ggml_type
    n = min(w.shape[0], 4096)  # a row slice keeps the 262144-row head quick
    sub = QWeight(name, w.raw[: n * w.row_bytes], w.ggml_type, (n, w.shape[1]))
    for m in (1, 3, 8, 12, 16, 512):  # 8 and 12: the AVX2 rows-in-lanes GEMV (Q8_0; 12: K-quants too)
        x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
        assert rel_err(run_linear(ops, sub, x), reference(ops, sub, x)) <= 1e-5, m


def test_rms_norm_and_rope_match_the_reference(ops) -> None:
    from ubatch.kernels.torch_ops import TorchOps

    ref = TorchOps()
    x, w = torch.randn(5, 3, 64) * 100, torch.randn(64)
    got = ops.rms_norm(x, w, 1e-6, torch.empty_like(x), [torch.empty(5, 3, 1)])
    want = ref.rms_norm(x, w, 1e-6, torch.empty_like(x), [torch.empty(5, 3, 1)])
    assert rel_err(got, want) <= 1e-6
    cos, sin = ref.rope_cache(torch.tensor([0, 7, 300, 4095, 12]), 48, 10000.0, 1.0)
    for neox in (True, False):  # 48 of 64 dims rotate, the rest are copied
        got = ops.rope(x, cos, sin, neox, torch.empty_like(x))
        want = ref.rope(x, cos, sin, neox, torch.empty_like(x))
        assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_argmax_rows_is_numpys_first_maximum(n_threads: int) -> None:
    """Greedy sampling's argmax (csrc/rowops.c on the C backends): numpy's index on every row,
    ties across lanes, chains and the threads' parts (the first wins), NaN (the first wins), -inf."""
    ops = [backends.create(b, n_threads=n_threads) for b in BACKENDS]
    gen = np.random.default_rng(n_threads)
    for n in (5, 64, 100, 8191, 8192, 8193, 262144, 262147):
        x = gen.standard_normal((9, n + 3)).astype(np.float32)  # rows n + 3 apart, n of each read
        x[1, :] = 1.0  # all equal: index 0
        x[2, [n - 1, n // 2, n // 2 + 1, 7 % n]] = 50.0  # ties at several places
        x[3, :] = -np.inf
        x[4, [n // 3, n - 1]] = np.nan
        x[5, [n - 1]] = np.nan
        x[6, [0, n - 1]] = 60.0
        x[7, n // 2 :] = 70.0  # the second thread's part all tied
        x[8, n - 1] = 80.0
        rows = torch.from_numpy(x)[:, :n]
        want = np.argmax(x[:, :n], axis=1).tolist()
        for o in ops:
            assert o.argmax_rows(rows) == want, (o.name, n)
            assert o.argmax_rows(rows[2:5]) == want[2:5], (o.name, n)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("t", [1, 3, 9, 40])
@pytest.mark.parametrize("heads", [(4, 1), (4, 2)], ids=["mqa", "gqa"])
def test_attention_matches_the_reference(ops, kv_type: str, t: int, heads: tuple[int, int]) -> None:
    """Two groups (streams) reading their own cells, masked cells and whole hidden chunks; the
    backend's own planned scratch (t = 40: several of the CPU's fused row blocks per chunk)."""
    attention_case(ops, kv_type, t, heads, 0.0)


@pytest.mark.parametrize("t", [1, 40])
def test_soft_capped_attention_matches_the_reference(ops, t: int) -> None:
    """gemma2's scores (c·tanh(s / c) before the scale) through the backend's own kernels: the
    CPU's decode pass (t = 1) and its fused prefill chunks (t = 40), not the reference's tiles."""
    attention_case(ops, "f16", t, (4, 2), 5.0)


def attention_case(ops, kv_type: str, t: int, heads: tuple[int, int], softcap: float) -> None:
    from ubatch.kernels.ops import KV_CHUNK, AttentionArgs, KVTensor
    from ubatch.kernels.quant.quantize import QUANTIZERS
    from ubatch.kernels.torch_ops import TorchOps

    h, hkv, d, g, n_kv, size = *heads, 64, 2, 512, 768
    gen = torch.Generator().manual_seed(t)
    rows = torch.randn(g * size, hkv, d, generator=gen)
    if kv_type == "q8_0":
        data, gt = QUANTIZERS[int(T.Q8_0)](rows.reshape(g * size, -1)), int(T.Q8_0)
    else:
        dt = torch.float32 if kv_type == "f32" else torch.float16
        data, gt = rows.to(dt), int(T.F32 if kv_type == "f32" else T.F16)
    k = KVTensor(data, gt, hkv, d)
    v = KVTensor(data.clone(), gt, hkv, d)
    q = torch.randn(g, t, h, d, generator=gen)
    vis = torch.rand(g, t, n_kv, generator=gen) > 0.3
    vis[:, :, 300:] = False  # the second chunk hidden from every query
    vis[:, :, 0] = True
    mask = torch.where(vis, 0.0, float("-inf")).half()
    starts = torch.tensor([0, size])
    visible = (mask != float("-inf")).view(g * t, n_kv // KV_CHUNK, KV_CHUNK).any(2).any(0)

    args = AttentionArgs(q * 4 if softcap else q, k, v, starts, n_kv, mask, 0.125, visible, softcap=softcap)

    def run(o):
        out = torch.empty(g * t, h * d)
        scratch = [torch.empty(s, dtype=dt) for s, dt in o.attention_scratch(q.shape, k, v, n_kv)]
        return o.attention(args, out, scratch)

    assert rel_err(run(ops), run(TorchOps())) <= 1e-5
    if softcap and ops.name == "cpu" and t <= ATTN_MAX_ROWS and kv_type != "q8_0":  # the C decode pass
        assert ops.kernels.attention(args, torch.empty(g * t, h * d)) is not None


@pytest.mark.parametrize("backend", ["cpu", "cpu-avx2", "cpu-portable"])
def test_every_backend_runs_the_tiny_models_like_the_reference(
    tiny_gemma_model, tiny_llama_model, backend: str
) -> None:
    """Prefill (tiles + GEMM) then decode steps (GEMV, C attention) against the torch backend."""
    from ubatch.engine.batch import Batch
    from ubatch.engine.context.context import Context
    from ubatch.engine.params import ContextParams

    for m in (tiny_gemma_model, tiny_llama_model):
        rows = {}
        for name in ("torch", backend):
            ctx = Context(m, ContextParams(n_ctx=256, n_ubatch=32, backend=name))
            ctx.decode(Batch.from_tokens([2] + list(range(10, 50)), 0, all_logits=True))
            got = [ctx.logits.clone()]
            for i in range(3):
                ctx.decode(Batch.from_tokens([60 + i], 41 + i))
                got.append(ctx.logits.clone())
            rows[name] = torch.cat(got)
        # x read as 16-bit integers (the AVX2 build): ~1.5e-5 per product, through every layer
        tol = 5e-4 if ctx.ops.kernels.x16 else 1e-4
        assert rel_err(rows[backend], rows["torch"]) <= tol


def test_without_a_compiler_auto_falls_back_to_the_reference(monkeypatch, tmp_path) -> None:
    from ubatch.kernels.cpu import build as cpu_build

    monkeypatch.setattr(cpu_build, "_LOADED", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    ops = backends.create("auto", 2)
    assert ops.name == "torch"
    assert any("CPU kernels unavailable" in n and "torch reference" in n for n in ops.notices)
    with pytest.raises(backends.BackendError, match="cannot run here"):
        backends.create("cpu", 2)
    with pytest.raises(backends.BackendError, match="unknown backend 'gpu0'"):
        backends.create("gpu0", 2)


def test_the_library_is_built_once_then_loaded_from_the_cache(monkeypatch, tmp_path) -> None:
    from ubatch.kernels.cpu import build as cpu_build

    monkeypatch.setattr(cpu_build, "_LOADED", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cold = cpu_build.load(portable=True)
    assert cold.built and cold.path.parent == tmp_path / "ubatch" / "kernels"
    monkeypatch.setattr(cpu_build, "_LOADED", {})
    warm = cpu_build.load(portable=True)
    assert not warm.built and warm.path == cold.path and warm.simd == "portable"


def test_a_type_without_a_kernel_is_dequantised_per_use_with_a_notice() -> None:
    """Q3_K has no C kernel: a one-line notice, and the product is still right."""
    ops = CpuOps(2)
    w = weight(T.Q3_K, 20, 256)
    x = torch.randn(3, 256)
    got = run_linear(ops, w, x)
    assert any(n.startswith("Q3_K has no CPU kernel") for n in ops.notices)
    assert "dequantise per use" in ops.kernel_path(int(T.Q3_K))
    assert rel_err(got, x.double() @ dequantize(w.raw, T.Q3_K, w.shape).double().t()) <= 1e-5


def test_a_cpu_without_avx2_gets_the_portable_build_with_a_notice(monkeypatch) -> None:
    from ubatch.kernels.cpu import build as cpu_build

    monkeypatch.setattr(cpu_build, "_LOADED", {})
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset({"sse2", "fma"}))
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    ops = backends.create("cpu", 2)
    assert ops.kernels.library.simd == "portable"
    assert any("CPU lacks avx2, f16c" in n and "portable" in n for n in ops.notices)


def test_the_native_build_is_512_bit_exactly_where_the_cpu_has_avx512() -> None:
    """`cpu` builds for the running CPU (zmm kernels with AVX-512F); `cpu-avx2` keeps the 256-bit
    kernels on any AVX2 CPU, so both code paths are tested here whatever this machine is."""
    from ubatch.kernels.cpu.build import FAST_FLAGS, cpu_flags

    flags = cpu_flags()
    if not set(FAST_FLAGS) <= flags:
        pytest.skip("this CPU has no AVX2/FMA/F16C: only the portable build runs here")
    native, avx2 = backends.create("cpu", 2), backends.create("cpu-avx2", 2)
    assert native.kernels.library.simd == ("avx512" if "avx512f" in flags else "avx2")
    assert avx2.kernels.library.simd == "avx2" and avx2.name == "cpu-avx2"
    assert native.kernel_path(int(T.Q4_K)).startswith(f"C {native.kernels.library.simd}: ")
    assert native.kernels.has_gemm and avx2.kernels.has_gemm
