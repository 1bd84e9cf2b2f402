"""llama.cpp's mul_mat_id on the GPU: each (token, chosen expert) row times that expert's matrix,
straight from the 3-D tensor's stored blocks.

One program computes BLOCK_N output values of one (token, chosen expert) pair: it reads the
expert's id on the device, offsets into that expert's 2-D slice (itself a valid quantised matrix)
and streams those rows' blocks as the one-row GEMV of kernels/cuda/triton/matmul.py does, so a
decode step reads the chosen experts' weights and no others, and no launch waits on the host
(the ids never leave the device: CUDA graphs capture it). Prefill reads an expert's rows once
per row that chose it; grouping the rows by expert into tl.dot tiles is left to do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ubatch.kernels.cuda.triton.matmul import GEMV_STAGES, SUPPORTED, _groups, weight_views
from ubatch.kernels.quant.dequant import type_name
from ubatch.kernels.quant.weight import QWeight

BLOCK_N, BLOCK_K, NUM_WARPS = 8, 512, 4  # the one-row GEMV's configuration (matmul.GEMV_CONFIGS[1])


@triton.jit
def mul_mat_id_kernel(
    x,
    wq,
    wh,
    gq,
    ids,
    bias,
    out,
    N,
    K,
    n_used,
    x_per,
    expert_bytes,
    row_bytes,
    TYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """grid (row blocks, pairs): out[pair, n..n+BLOCK_N) for pair = token · n_used + j."""
    pair = tl.program_id(1)
    e = tl.load(ids + pair).to(tl.int64)
    t, j = pair // n_used, pair % n_used
    xr = x + ((t * x_per + tl.where(x_per > 1, j, 0)).to(tl.int64) * K)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rb = e * expert_bytes + n.to(tl.int64)[:, None, None] * row_bytes
    part = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=GEMV_STAGES):
        w, k = _groups(wq, wh, gq, rb, n_ok[:, None, None], k0, K, TYPE, BLOCK_K)
        part += w * tl.load(xr + k, mask=k < K, other=0.0)
    acc = tl.sum(tl.sum(part, axis=2), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias + e * N + n, mask=n_ok, other=0.0)
    tl.store(out + pair.to(tl.int64) * N + n, acc, mask=n_ok)


def mul_mat_id(
    x: torch.Tensor, w: QWeight, ids: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """out (n, k, rows) from x (n, 1 | k, cols) f32 contiguous, ids (n, k) int32, w (E, rows, cols)."""
    t = int(w.ggml_type)
    if t not in SUPPORTED:
        raise NotImplementedError(f"no Triton mul_mat_id kernel for {type_name(t)} (tensor {w.name})")
    n_expert, rows, cols = w.shape
    n, k = ids.shape
    raw, wh, gq = weight_views(w, "mul_mat_id")
    eb = raw.numel() // n_expert
    bias = b if b is not None else out
    grid = (triton.cdiv(rows, BLOCK_N), n * k)
    mul_mat_id_kernel[grid](
        x, raw, wh, gq, ids, bias, out, rows, cols, k, x.shape[1], eb, eb // rows,
        TYPE=t, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, HAS_BIAS=b is not None, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


_SIGNATURE = {
    "x": "*fp32",
    "wq": "*u8",
    "wh": "*i16",
    "gq": "*u8",
    "ids": "*i32",
    "bias": "*fp32",
    "out": "*fp32",
    **dict.fromkeys(("N", "K", "n_used", "x_per"), "i32"),
    **dict.fromkeys(("expert_bytes", "row_bytes"), "i64"),
    **dict.fromkeys(("TYPE", "BLOCK_N", "BLOCK_K", "HAS_BIAS"), "constexpr"),
}

COMPILE_SPECS: list[tuple] = [
    (
        f"moe.mul_mat_id[{type_name(t)},bias={hb}]",
        mul_mat_id_kernel,
        dict(_SIGNATURE),
        {"TYPE": t, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "HAS_BIAS": hb},
        {"num_warps": NUM_WARPS},
    )
    for t in sorted(SUPPORTED)
    for hb in (False, True)
]
