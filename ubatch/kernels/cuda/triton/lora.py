"""The segmented LoRA product (kernels/ops.py `LoraArgs`, Punica's BGMV) in Triton: one launch per
targeted matrix for every adapter of a ubatch. A program takes one row and BLOCK_N output
columns: for each of the row's adapter slots it gathers that adapter's A (R, n_in) from the stack,
computes t = c · scale · A x in f32 a BLOCK_K slice of x at a time, and adds t · Bᵀ over its
columns; then out = y + the sum. Zero-padded ranks and adapters that do not target the matrix
contribute zeros. Each program reads only its own row, so a row's result never depends on the
rows sharing the launch. Every program of a row recomputes A x (rank x n_in multiply-adds, small
beside the B product's columns), which keeps it one launch with no scratch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ubatch.kernels.ops import LoraArgs

# output columns per program and values of x per step of A x: 128 each up to rank 32, then fewer,
# so that an (R, block) tile of A or Bᵀ stays at 8192 values (measured on the sm_90 compile: no
# spills at ranks 16 to 256 as the JIT specialises aligned arguments, the common case; unaligned
# rank 256 spills)
TILE = 8192
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the stacks' factor types


@triton.jit
def lora_kernel(
    Y, X, A, BT, C, IDX, SCALE, SEL, OUT, n_in, n_out, r_max,
    M: tl.constexpr, R: tl.constexpr, HAS_SEL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[r, cols] = y[r, cols] + Σ_j c[k] · scale[s, j] · (A_k x[r]) · Bᵀ_k[:, cols], k = idx[s, j]
    (s = sel[r] with HAS_SEL, else r); slots with k < 0 skipped. R: r_max rounded up to a power of two."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < n_out
    if HAS_SEL:
        s = tl.load(SEL + r).to(tl.int64)
    else:
        s = r
    q = tl.arange(0, R)
    qm = q < r_max
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(M):
        k = tl.load(IDX + s * M + j).to(tl.int64)
        if k >= 0:
            f = tl.load(SCALE + s * M + j) * tl.load(C + k)
            t = tl.zeros([R], dtype=tl.float32)
            for c0 in range(0, n_in, BLOCK_K):
                ci = c0 + tl.arange(0, BLOCK_K)
                xm = ci < n_in
                xv = tl.load(X + r * n_in + ci, mask=xm, other=0.0)
                a_ptr = A + (k * r_max + q[:, None]) * n_in + ci[None, :]
                av = tl.load(a_ptr, mask=qm[:, None] & xm[None, :], other=0.0).to(tl.float32)
                t += tl.sum(av * xv[None, :], axis=1)
            t = t * f
            b_ptr = BT + (k * r_max + q[:, None]) * n_out + cols[None, :]
            bv = tl.load(b_ptr, mask=qm[:, None] & cm[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(t[:, None] * bv, axis=0)
    y = tl.load(Y + r * n_out + cols, mask=cm, other=0.0)
    tl.store(OUT + r * n_out + cols, y + acc, mask=cm)


def rank_block(r_max: int) -> int:
    return max(16, triton.next_power_of_2(r_max))


def col_block(r: int) -> int:
    """BLOCK_N and BLOCK_K for a rank block r."""
    return min(128, max(16, TILE // r))


def supported(a: LoraArgs[torch.Tensor], out: torch.Tensor) -> bool:
    """Contiguous f32 rows, a float stack, int32 adapter ids (int64 sel): what the kernel reads."""
    w = a.w
    return (
        w.a.dtype in DTYPES
        and w.bt.dtype == w.a.dtype
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in (a.x, a.y, out, a.scale, w.c))
        and w.a.is_contiguous()
        and w.bt.is_contiguous()
        and a.idx.dtype == torch.int32
        and a.idx.is_contiguous()
        and (a.sel is None or (a.sel.dtype == torch.int64 and a.sel.is_contiguous()))
    )


def lora(a: LoraArgs[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The op into out (which may be a.y); the caller checked `supported`."""
    n, n_out = a.x.shape[0], a.y.shape[1]
    _, r_max, n_in = a.w.a.shape
    if n == 0 or n_out == 0:
        return out
    sel = a.sel if a.sel is not None else a.idx
    r = rank_block(r_max)
    b = col_block(r)
    lora_kernel[(n, triton.cdiv(n_out, b))](
        a.y, a.x, a.w.a, a.w.bt, a.w.c, a.idx, a.scale, sel, out, n_in, n_out, r_max,
        M=a.idx.shape[1], R=r, HAS_SEL=a.sel is not None, BLOCK_N=b, BLOCK_K=b,
    )  # fmt: skip
    return out


def _sig(t: str) -> dict[str, str]:
    """The kernel's signature with factors of Triton type t, in argument order."""
    ptrs = {"Y": "*fp32", "X": "*fp32", "A": f"*{t}", "BT": f"*{t}", "C": "*fp32", "IDX": "*i32", "SCALE": "*fp32"}
    rest = {"SEL": "*i64", "OUT": "*fp32", "n_in": "i32", "n_out": "i32", "r_max": "i32"}
    return {**ptrs, **rest, **dict.fromkeys(("M", "R", "HAS_SEL", "BLOCK_N", "BLOCK_K"), "constexpr")}


COMPILE_SPECS = [
    (f"lora[{t},M{m},R{r}{',sel' if sel else ''}]", lora_kernel, _sig(t),
     {"M": m, "R": r, "HAS_SEL": sel, "BLOCK_N": col_block(r), "BLOCK_K": col_block(r)})
    for t in ("fp32", "fp16", "bf16") for r in (16, 64, 256) for m, sel in ((1, False), (2, True))
]  # fmt: skip
