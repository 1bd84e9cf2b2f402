"""Prefill's GEMM on AMX tiles (kernels/cpu/csrc/amx.c) is as accurate as the f32 FMA kernel.

The tile products multiply bf16 values; the kernel splits each f32 value into three bf16 parts
and sums the six part products that matter, so its error against an f64 reference must stay at
the f32 kernel's (`cpu-noamx`), on every weight type and across the kernel's edges: row strips
padded to 32, column tiles padded to pairs of 16, k slices of 256 with a short last one. Skipped
where the CPU (or the kernel) gives no AMX tiles; `cpu-noamx` runs everywhere via test_kernels.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_kernels import QUANT, rel_err, run_linear, weight

from ubatch.kernels import backends
from ubatch.kernels.cpu.bind import AMX_MIN_ROWS
from ubatch.kernels.ops import LinearArgs
from ubatch.kernels.quant.dequant import dequantize


@pytest.fixture(scope="module")
def amx():
    ops = backends.create("cpu", n_threads=2)
    if not ops.kernels.amx:
        pytest.skip("no AMX tiles on this CPU (or for this process): the f32 GEMM is the only one")
    return ops


@pytest.fixture(scope="module")
def f32():
    return backends.create("cpu-noamx", n_threads=2)


@pytest.mark.parametrize("m,n,k", [(128, 200, 512), (131, 50, 800), (160, 33, 256), (515, 64, 1024)])
@pytest.mark.parametrize("t", QUANT + [T.F16, T.BF16], ids=lambda t: t.name)
def test_amx_gemm_is_as_accurate_as_the_f32_kernel(amx, f32, t: T, m: int, n: int, k: int) -> None:
    block, _ = GGML_QUANT_SIZES[t]
    k = max(block, k // block * block) + (t == T.F16)  # an odd k where the type allows it
    w = weight(t, n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    want = x.double() @ dequantize(w.raw, t, w.shape).double().t()
    got, ref = run_linear(amx, w, x), run_linear(f32, w, x)
    assert not got.isnan().any()  # every output written, padded rows and columns never stored
    # the K-quants' reference is their integer GEMM (x to 2^-24), tighter than f32's FMA chain:
    # there the tiles are held to f32's own level (RMS 4.5-8.1e-7 on the layer shapes, docs/backends.md)
    floor = 8e-7 if t in (T.Q4_K, T.Q5_K, T.Q6_K) else 2e-7
    assert rel_err(got, want) <= max(2 * rel_err(ref, want), floor), (rel_err(got, want), rel_err(ref, want))


def test_values_far_from_one_keep_their_low_bits(amx, f32) -> None:
    """A split that lost a part (or rounded the residuals) shows on values with full mantissas."""
    w = weight(T.F16, 96, 640, seed=3)
    x = (torch.randn(256, 640, generator=torch.Generator().manual_seed(5)) * 1e3) + 1 / 3
    want = x.double() @ dequantize(w.raw, T.F16, w.shape).double().t()
    assert rel_err(run_linear(amx, w, x), want) <= max(2 * rel_err(run_linear(f32, w, x), want), 2e-7)


def test_the_tiles_are_taken_from_amx_min_rows(amx, f32) -> None:
    w = weight(T.Q4_K, 64, 256)
    for ops, m, op in ((amx, AMX_MIN_ROWS, "gemm_amx"), (amx, AMX_MIN_ROWS - 1, "gemm"), (f32, 512, "gemm")):
        x, out = torch.randn(m, 256), torch.empty(m, 64)
        scratch = [torch.empty(s, dtype=d) for s, d in ops.linear_scratch(m, w)]
        assert ops.kernels.bind(LinearArgs(x, w), out, scratch).op == op, (ops.name, m)
    assert "AMX tiles" in amx.kernel_path(int(T.Q4_K)) and "AMX" not in f32.kernel_path(int(T.Q4_K))


def test_floats_stay_on_blas(amx) -> None:
    """F32 weights take torch's GEMM on every CPU build, AMX or not."""
    w = weight(T.F32, 40, 96)
    x = torch.randn(200, 96)
    assert amx.linear_scratch(200, w) == []
    assert rel_err(run_linear(amx, w, x), x.double() @ dequantize(w.raw, T.F32, w.shape).double().t()) <= 1e-6


def test_a_prefill_through_the_tiles_matches_the_reference(amx, tiny_gemma_model, tiny_llama_model) -> None:
    """Whole prefills of the tiny models (a 200-token ubatch: the tiles) against the torch reference,
    within the bound every CPU build meets (test_kernels). Which of two f32-accurate sums lies
    nearer MKL's depends on their order, so accuracy itself is measured above, against f64."""
    from ubatch.engine.batch import Batch
    from ubatch.engine.context.context import Context
    from ubatch.engine.params import ContextParams

    ids = [2] + [10 + (7 * i) % 50 for i in range(199)]
    for model in (tiny_gemma_model, tiny_llama_model):
        rows = {}
        for name in ("torch", "cpu"):
            ctx = Context(model, ContextParams(n_ctx=256, n_ubatch=256, backend=name))
            ctx.decode(Batch.from_tokens(ids, 0, all_logits=True))
            rows[name] = ctx.logits.clone()
        assert rel_err(rows["cpu"], rows["torch"]) <= 1e-4


@pytest.mark.parametrize("n_threads", [1, 3])
def test_strided_rows_and_any_thread_count(f32, n_threads: int) -> None:
    """x a column slice of a wider buffer (ldx > k) and y a column slice of a wider output (ldy >
    n), as workspace views are, on 1 thread and on more threads than weight blocks."""
    ops = backends.create("cpu", n_threads=n_threads)
    if not ops.kernels.amx:
        pytest.skip("no AMX tiles on this CPU (or for this process)")
    w = weight(T.Q6_K, 48, 512, seed=7)
    big = torch.randn(200, 600, generator=torch.Generator().manual_seed(9))
    x = big[:, 40:552]
    wide = torch.full((200, 80), float("nan"))
    out = wide[:, 8:56]
    scratch = [torch.empty(s, dtype=d) for s, d in ops.linear_scratch(200, w)]
    ops.prepare_weights([w])
    ops.linear(x, w, out, scratch)
    want = x.double() @ dequantize(w.raw, T.Q6_K, w.shape).double().t()
    assert rel_err(out, want) <= max(2 * rel_err(run_linear(f32, w, x.contiguous()), want), 2e-7)
    assert wide[:, :8].isnan().all() and wide[:, 56:].isnan().all()  # nothing written beside y
