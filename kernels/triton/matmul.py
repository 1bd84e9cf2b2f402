"""Quantised matmul with fused dequantisation: out[m, n] = x[m, :] @ dense(w)[n, :] on the GPU.

The weights stay the GGUF bytes (`QWeight.raw`, rows of blocks along ne0); each kernel
dequantises the blocks it reads in registers (kernels/triton/quant_tiles.py) and accumulates in
f32. Two shapes:

- `gemv_kernel` (decode, m <= 16 rows of x): one program owns BLOCK_N weight rows and streams
  their blocks once for all m rows (x is tiny and stays in cache), a broadcast multiply and a
  reduction per K tile. BLOCK_M (the padded row count: 1, 2, 4, 8, 16) sets the tile shape so
  the product tile stays at 4096-8192 elements per program (registers, not spills).
- `tiled_kernel` (prefill, m > 16): a [BLOCK_M, BLOCK_N] output tile per program; each K step
  dequantises a [BLOCK_K, BLOCK_N] weight tile and feeds tl.dot with input_precision "tf32x3"
  (three tf32 MMAs: f32-level error on tensor cores; plain tf32 would lose ~3 digits).

Launches do no host sync (grids come from shapes, no .item()), so a CUDA graph can capture them.
The block sizes are first choices for sm_90, to be tuned on a device; tests in interpreter mode
use the same kernels on tiny shapes.

COMPILE_SPECS format (shared by every kernels/triton module; scripts/triton_compile_check.py
compiles each entry for GPUTarget("cuda", 90, 32)): a list of tuples
    (name: str, fn: triton.JITFunction, signature: dict[str, str], constexprs: dict[str, object])
optionally followed by a 5th element, options: dict[str, object] (triton.compile options such
as num_warps / num_stages; the launch must pass the same ones). `signature` names every
argument of `fn` in order, with Triton type strings ("*fp32", "*u8", "*i16", "i32", "fp32")
and "constexpr" for constexpr arguments, whose values are in `constexprs`. One entry per
specialisation the backend can launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dequant import type_name
from ..weight import QWeight
from .quant_tiles import BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, weight_tile

SUPPORTED: frozenset[int] = frozenset((F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K))
GEMV_MAX_ROWS = 16
# padded rows -> (BLOCK_N, BLOCK_K); BLOCK_M * BLOCK_N * BLOCK_K stays <= 8192
GEMV_CONFIGS: dict[int, tuple[int, int]] = {1: (16, 256), 2: (16, 128), 4: (16, 64), 8: (16, 32), 16: (16, 32)}
TILED_CONFIG = (64, 64, 64)  # BLOCK_M, BLOCK_N, BLOCK_K
NUM_WARPS = 4


@triton.jit
def gemv_kernel(
    x,
    wq,
    wh,
    out,
    M,
    N,
    K,
    row_bytes,
    stride_xm,
    stride_om,
    TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows [pid * BLOCK_N, +BLOCK_N) of out for all M (<= BLOCK_M) rows of x."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    rb = n.to(tl.int64)[:, None] * row_bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = weight_tile(wq, wh, rb, k[None, :], n_ok[:, None] & k_ok[None, :], TYPE)  # [BN, BK]
        xt = tl.load(x + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(xt[:, None, :] * w[None, :, :], axis=2)
    tl.store(out + m[:, None] * stride_om + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def tiled_kernel(
    x,
    wq,
    wh,
    out,
    M,
    N,
    K,
    row_bytes,
    stride_xm,
    stride_om,
    TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The [BLOCK_M, BLOCK_N] tile of out at (pid 1, pid 0): weight tiles dequantised, tl.dot."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    rb = n.to(tl.int64)[None, :] * row_bytes
    xrow = x + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = weight_tile(wq, wh, rb, k[:, None], k_ok[:, None] & n_ok[None, :], TYPE)  # [BK, BN]
        xt = tl.load(xrow + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xt, w, acc, input_precision="tf32x3")
    o = out + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(o, acc, mask=m_ok[:, None] & n_ok[None, :])


def gemv_rows(m: int) -> int:
    """The padded row count (BLOCK_M) of the GEMV specialisation for m rows."""
    return 1 << max(0, m - 1).bit_length()


def linear(x: torch.Tensor, w: QWeight, out: torch.Tensor) -> torch.Tensor:
    """out = x @ dense(w).T from the stored blocks; x f32 [m, k], out f32 [m, n], both row-major."""
    t = int(w.ggml_type)
    if t not in SUPPORTED:
        raise NotImplementedError(f"no Triton matmul kernel for {type_name(t)} (tensor {w.name})")
    m, k = x.shape
    n = w.shape[0]
    if tuple(w.shape) != (n, k) or tuple(out.shape) != (m, n):
        raise ValueError(f"linear: x {tuple(x.shape)} @ {w.name} {tuple(w.shape)} -> out {tuple(out.shape)}")
    if x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("linear: x and out must be f32 with contiguous rows")
    raw = w.raw.reshape(-1)
    if raw.storage_offset() % 2 or raw.numel() % 2:
        raise ValueError(f"linear: {w.name}'s bytes must start at an even offset (f16 fields are read as 16-bit)")
    args = (x, raw, raw.view(torch.int16), out, m, n, k, raw.numel() // n, x.stride(0), out.stride(0))
    if m <= GEMV_MAX_ROWS:
        bm = gemv_rows(m)
        bn, bk = GEMV_CONFIGS[bm]
        grid = (triton.cdiv(n, bn),)
        gemv_kernel[grid](*args, TYPE=t, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=NUM_WARPS)
    else:
        bm, bn, bk = TILED_CONFIG
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
        tiled_kernel[grid](*args, TYPE=t, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=NUM_WARPS)
    return out


_SIGNATURE = {
    "x": "*fp32",
    "wq": "*u8",
    "wh": "*i16",
    "out": "*fp32",
    **dict.fromkeys(("M", "N", "K", "row_bytes", "stride_xm", "stride_om"), "i32"),
    **dict.fromkeys(("TYPE", "BLOCK_M", "BLOCK_N", "BLOCK_K"), "constexpr"),
}


def _spec(kind: str, fn: object, t: int, bm: int, bn: int, bk: int) -> tuple:
    consts = {"TYPE": t, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    name = f"matmul.{kind}[{type_name(t)},m{bm},n{bn},k{bk}]"
    return (name, fn, dict(_SIGNATURE), consts, {"num_warps": NUM_WARPS})


COMPILE_SPECS: list[tuple] = [
    *(_spec("gemv", gemv_kernel, t, bm, *cfg) for t in sorted(SUPPORTED) for bm, cfg in GEMV_CONFIGS.items()),
    *(_spec("tiled", tiled_kernel, t, *TILED_CONFIG) for t in sorted(SUPPORTED)),
]
