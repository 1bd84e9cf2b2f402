"""Quantised matmul with fused dequantisation: out[m, n] = x[m, :] @ dense(w)[n, :] on the GPU.

The weights stay the GGUF bytes (`QWeight.raw`, rows of blocks along ne0); each kernel
dequantises the blocks it reads in registers (kernels/cuda/triton/quant_tiles.py) and accumulates in
f32. Two shapes:

- GEMV (decode, m <= 16 rows of x): one program owns BLOCK_N weight rows and streams
  their blocks once for all m rows (x is tiny and stays in cache). One row: element-wise partial
  sums over a software-pipelined K loop, reduced once at the end; 2..16 rows: the rows padded
  to 16 and tl.dot (tensor-core work is free while the weights' bytes bound the time).
- tiled (prefill, m > 16): a [BLOCK_M, BLOCK_N] output tile per program; each K step
  dequantises a [BLOCK_K, BLOCK_N] weight tile and feeds tl.dot.

Both are `matmul_kernel`, told apart by the constexpr GEMV (one kernel, one signature).

Every tl.dot uses input_precision "tf32x3" (three tf32 MMAs: f32-level error on tensor cores;
plain tf32 would lose ~3 digits, and Gemma's activations reach 1e5).

Launches do no host sync (grids come from shapes, no .item()), so a CUDA graph can capture them.
The block sizes are first choices for sm_90 (none spills registers), to be tuned on a device
with scripts/triton_matmul_bench.py --sweep; the interpreter tests run the same kernels on tiny
shapes.

COMPILE_SPECS format (shared by every kernels/triton module; scripts/triton_compile_check.py
compiles each entry for GPUTarget("cuda", 90, 32)): a list of tuples
    (name: str, fn: triton.JITFunction, signature: dict[str, str], constexprs: dict[str, object])
optionally followed by a 5th element, options: dict[str, object] (triton.compile options such
as num_warps / num_stages; the launch must pass the same ones). `signature` names every
argument of `fn` in order, with Triton type strings ("*fp32", "*u8", "*i16", "i32", "fp32")
and "constexpr" for constexpr arguments, whose values are in `constexprs`. One entry per
specialisation the backend can launch (the script's --aligned also compiles each as the JIT
specialises 16-aligned arguments).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ubatch.kernels.cuda.triton.quant_tiles import (
    BF16,
    F16,
    F32,
    GRID_OF,
    IQ1_M,
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    TQ1_0,
    TQ2_0,
    weight_groups,
)
from ubatch.kernels.quant.dequant import type_name
from ubatch.kernels.quant.dequant_iq import grid_raw
from ubatch.kernels.quant.weight import QWeight

SUPPORTED: frozenset[int] = frozenset(
    (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS)
    + (IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0)
)
GEMV_MAX_ROWS = 16
# Block sizes for sm_90, chosen so that no specialisation spills registers (cuobjdump, see
# scripts/triton_compile_check.py); to be tuned by measurement on a device.
# GEMV: padded rows (BLOCK_M) -> (BLOCK_N, BLOCK_K, num_warps)
GEMV_CONFIGS: dict[int, tuple[int, int, int]] = {1: (8, 512, 4), GEMV_MAX_ROWS: (64, 32, 4)}
# The one-row loop is software-pipelined like the tl.dot loops are by default: without it a
# program has one K tile of blocks in flight, a few KB per SM, far from what hides DRAM latency.
GEMV_STAGES: tl.constexpr = tl.constexpr(3)
TILED_CONFIG = (128, 64, 32, 8)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps
DOT_PRECISION: tl.constexpr = tl.constexpr("tf32x3")


@triton.jit
def _groups(wq, wh, gq, rb, n_ok, k0, K, TYPE: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BN, BLOCK_K // 32, 32] dequantised tile of columns k0.. of the rows at offsets rb [BN, 1, 1]."""
    s = (k0 // 32 + tl.arange(0, BLOCK_K // 32))[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    k = s * 32 + lane
    if TYPE == 0:  # float rows may end mid-group: mask elements
        mask = n_ok & (k < K)
    elif TYPE == 1:
        mask = n_ok & (k < K)
    elif TYPE == 30:
        mask = n_ok & (k < K)
    else:  # block rows are whole groups: mask groups (scales are loaded per group)
        mask = n_ok & (s * 32 < K)
    return weight_groups(wq, wh, gq, rb, s, lane, mask, TYPE), k


@triton.jit
def _dot_rows(
    x, wq, wh, gq, rb, n_ok, m, m_ok, K, stride_xm, TYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """sum over K of x[m, k] * w[n, k] for the rows m and the weight rows at rb, on tensor cores."""
    xrow = x + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((m.shape[0], BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, _ = _groups(wq, wh, gq, rb, n_ok, k0, K, TYPE, BLOCK_K)
        w = tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K)))  # [BK, BN]
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(xrow + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0)
        acc = tl.dot(xt, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def matmul_kernel(
    x,
    wq,
    wh,
    gq,
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
    GEMV: tl.constexpr,
):
    """GEMV (grid: weight row blocks): rows [pid * BLOCK_N, +BLOCK_N) of out for all M (<=
    BLOCK_M) rows of x, so each weight block is read once. One row: element-wise partial sums
    reduced after the loop; up to 16: tl.dot with the rows padded to 16 (tensor-core work is free
    while the weights' bytes bound the time). Tiled (grid: (weight row blocks, x row blocks)):
    the [BLOCK_M, BLOCK_N] tile of out at (pid 1, pid 0), weight tiles dequantised for tl.dot."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GEMV:
        m = tl.arange(0, BLOCK_M)
    else:
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    rb = n.to(tl.int64)[:, None, None] * row_bytes
    if BLOCK_M == 1:
        part = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=GEMV_STAGES):  # cp.async keeps blocks in flight
            w, k = _groups(wq, wh, gq, rb, n_ok[:, None, None], k0, K, TYPE, BLOCK_K)  # [BN, NS, 32]
            part += w * tl.load(x + k, mask=k < K, other=0.0)
        acc = tl.sum(tl.sum(part, axis=2), axis=1)[None, :]
    else:
        acc = _dot_rows(x, wq, wh, gq, rb, n_ok[:, None, None], m, m_ok, K, stride_xm, TYPE, BLOCK_N, BLOCK_K)
    if GEMV:  # at most 16 rows: 32-bit offsets
        o = out + m[:, None] * stride_om + n[None, :]
    else:
        o = out + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(o, acc, mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def grid_table(t: int, device: torch.device) -> torch.Tensor:
    """The grid a grid type's tiles read (GRID_OF), as bytes on the weights' device, once per device."""
    return torch.frombuffer(bytearray(grid_raw(GRID_OF[t])), dtype=torch.uint8).to(device)


def weight_views(w: QWeight, op: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three pointers a kernel reads a weight's blocks through: the bytes (`wq`), the same
    bytes as int16 (`wh`: f16 fields in one aligned load) and the grid of a grid type (`gq`; the
    bytes again for the others). Every type with f16 fields has even blocks; MXFP4's odd 17-byte
    blocks have none, so the 16-bit view may leave out a last odd byte."""
    raw = w.raw.reshape(-1)
    if raw.storage_offset() % 2:
        raise ValueError(f"{op}: {w.name}'s bytes must start at an even offset (f16 fields are read as 16-bit)")
    t = int(w.ggml_type)
    gq = grid_table(t, raw.device) if t in GRID_OF else raw
    return raw, raw[: raw.numel() // 2 * 2].view(torch.int16), gq


def gemv_rows(m: int) -> int:
    """The padded row count (BLOCK_M) of the GEMV specialisation for m rows."""
    return 1 if m == 1 else GEMV_MAX_ROWS


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
    raw, wh, gq = weight_views(w, "linear")
    args = (x, raw, wh, gq, out, m, n, k, raw.numel() // n, x.stride(0), out.stride(0))
    if m <= GEMV_MAX_ROWS:
        bm = gemv_rows(m)
        bn, bk, nw = GEMV_CONFIGS[bm]
        matmul_kernel[(triton.cdiv(n, bn),)](*args, TYPE=t, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GEMV=True, num_warps=nw)
    else:
        bm, bn, bk, nw = TILED_CONFIG
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
        matmul_kernel[grid](*args, TYPE=t, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GEMV=False, num_warps=nw)
    return out


_SIGNATURE = {
    "x": "*fp32",
    "wq": "*u8",
    "wh": "*i16",
    "gq": "*u8",
    "out": "*fp32",
    **dict.fromkeys(("M", "N", "K", "row_bytes", "stride_xm", "stride_om"), "i32"),
    **dict.fromkeys(("TYPE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GEMV"), "constexpr"),
}


def _spec(kind: str, t: int, bm: int, bn: int, bk: int, nw: int) -> tuple:
    consts = {"TYPE": t, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GEMV": kind == "gemv"}
    name = f"matmul.{kind}[{type_name(t)},m{bm},n{bn},k{bk}]"
    return (name, matmul_kernel, dict(_SIGNATURE), consts, {"num_warps": nw})


COMPILE_SPECS: list[tuple] = [
    *(_spec("gemv", t, bm, *cfg) for t in sorted(SUPPORTED) for bm, cfg in GEMV_CONFIGS.items()),
    *(_spec("tiled", t, *TILED_CONFIG) for t in sorted(SUPPORTED)),
]
