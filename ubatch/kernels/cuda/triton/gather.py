"""Triton kernels that read or write rows in a ggml storage type: the embedding gather from a
weight's GGUF blocks (f32 / f16 / bf16 / Q8_0 / Q4_0), the gather of f32 activation rows (the
last layer's output rows) and the K/V write into cache cells (f32 / f16 / bf16 caches, and Q8_0
quantised as ggml's reference quantiser does).

Block scales are read and written as 16-bit words of the byte rows (every row of these types
is an even number of bytes, and each block's scale starts at an even offset), so one uint8
tensor serves as bytes, int8 codes and f16 scales through three views.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from ubatch.kernels.quant.weight import QWeight

GATHER_BLOCK = 256  # columns per program (a multiple of every block size: 32)
ROWS_BLOCK = 1024  # columns per program of the activation rows' gather
FLOAT_TYPES = {int(T.F32): torch.float32, int(T.F16): torch.float16, int(T.BF16): torch.bfloat16}
GET_ROWS_TYPES = frozenset({*FLOAT_TYPES, int(T.Q8_0), int(T.Q4_0)})
KV_STORE_TYPES = frozenset({*FLOAT_TYPES, int(T.Q8_0)})
EXACT = {"enable_fp_fusion": False}  # the quantiser's x·(1/d) + 0.5 must round twice, as ggml's C does


@triton.jit
def _f16_at(W16, byte_off):
    """The little-endian f16 at an even byte offset of a byte tensor seen as int16 words."""
    return tl.load(W16 + byte_off // 2).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def get_rows_float_kernel(W, IDX, Y, k, BLOCK: tl.constexpr):
    """out[r] = w[idx[r]] for rows of k floats (any float dtype), as f32."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = c < k
    src = tl.load(IDX + r)
    tl.store(Y + r * k + c, tl.load(W + src * k + c, mask=m).to(tl.float32), mask=m)


@triton.jit
def get_rows_quant_kernel(W8, W16, IDX, Y, k, row_bytes, Q4: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = dequantised row idx[r]: Q8_0 (d, 32 int8) or Q4_0 (d, 16 bytes of nibbles:
    element j < 16 the low nibble of byte j, j >= 16 the high nibble of byte j - 16)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = c < k
    base = tl.load(IDX + r) * row_bytes
    b, j = c // 32, c % 32
    if Q4:
        blk = base + b * 18
        byte = tl.load(W8 + blk + 2 + (j % 16), mask=m, other=0).to(tl.uint8, bitcast=True)
        q = tl.where(j < 16, byte & 15, byte >> 4).to(tl.float32) - 8.0
    else:
        blk = base + b * 34
        q = tl.load(W8 + blk + 2 + j, mask=m, other=0).to(tl.float32)
    d = tl.load(W16 + blk // 2, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    tl.store(Y + r * k + c, d * q, mask=m)


@triton.jit
def kv_store_float_kernel(X, CELLS, D, width, BF16: tl.constexpr, BLOCK: tl.constexpr):
    """data[cells[r]] = x[r] cast to the cache's float type; BF16: D is the cache as int16 and
    the rounding (to nearest, ties to even) is done on the bits, the same compiled or interpreted."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = c < width
    cell = tl.load(CELLS + r)
    x = tl.load(X + r * width + c, mask=m)
    if BF16:
        u = x.to(tl.uint32, bitcast=True)
        y = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        y = x.to(D.dtype.element_ty)
    tl.store(D + cell * width + c, y, mask=m)


@triton.jit
def kv_store_q8_0_kernel(X, CELLS, D8, D16, width, row_bytes, NB: tl.constexpr):
    """Row r quantised to Q8_0 at cell cells[r], NB blocks per program: d = amax / 127,
    q = roundf(x / d) (halves away from zero), d stored as f16 (ggml's reference quantiser)."""
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64) * NB + tl.arange(0, NB)[:, None]
    j = tl.arange(0, 32)[None, :]
    m = b < width // 32
    x = tl.load(X + r * width + b * 32 + j, mask=m, other=0.0)
    d = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)[:, None]
    inv = tl.where(d == 0.0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0.0, 1.0, d)))
    v = x * inv
    q = tl.where(v < 0.0, -tl.floor(0.5 - v), tl.floor(v + 0.5)).to(tl.int8)
    blk = tl.load(CELLS + r) * row_bytes + b * 34
    tl.store(D8 + blk + 2 + j, q, mask=m)
    tl.store(D16 + blk // 2, d.to(tl.float16).to(tl.int16, bitcast=True), mask=m)


def _grid(n: int, k: int, block: int) -> tuple[int, int]:
    return (n, triton.cdiv(k, block))


def get_rows(w: QWeight, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64) of a weight in GET_ROWS_TYPES, dequantised into out (n, k) f32."""
    n, k = ids.numel(), w.shape[1]
    if n == 0:
        return out
    if w.ggml_type in FLOAT_TYPES:
        get_rows_float_kernel[_grid(n, k, GATHER_BLOCK)](
            w.raw.view(FLOAT_TYPES[w.ggml_type]), ids, out, k, BLOCK=GATHER_BLOCK
        )
        return out
    raw = w.raw.reshape(-1)
    get_rows_quant_kernel[_grid(n, k, GATHER_BLOCK)](
        raw.view(torch.int8), raw.view(torch.int16), ids, out, k, w.row_bytes,
        Q4=w.ggml_type == T.Q4_0, BLOCK=GATHER_BLOCK,
    )  # fmt: skip
    return out


def rows(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows `idx` (int64) of contiguous f32 rows x into out."""
    width = x[0].numel() if x.shape[0] else 0
    if idx.numel() and width:
        block = min(triton.next_power_of_2(width), ROWS_BLOCK)
        get_rows_float_kernel[_grid(idx.numel(), width, block)](x, idx, out, width, BLOCK=block)
    return out


def kv_store(data: torch.Tensor, ggml_type: int, cells: torch.Tensor, x: torch.Tensor) -> None:
    """Rows x (n, ...) f32 contiguous written at `cells` (int64) of a cache in KV_STORE_TYPES."""
    n = x.shape[0]
    if n == 0:
        return
    width = x.numel() // n
    if ggml_type == T.Q8_0:
        flat = data.view(-1)
        nb = min(8, triton.next_power_of_2(width // 32))
        kv_store_q8_0_kernel[_grid(n, width // 32, nb)](
            x, cells, flat.view(torch.int8), flat.view(torch.int16), width, data.shape[1], NB=nb, **EXACT
        )
        return
    block = min(GATHER_BLOCK * 4, triton.next_power_of_2(width))
    bf16 = ggml_type == T.BF16
    dst = data.view(torch.int16) if bf16 else data
    kv_store_float_kernel[_grid(n, width, block)](x, cells, dst, width, BF16=bf16, BLOCK=block)


COMPILE_SPECS = [
    *[
        (f"get_rows_{t}", get_rows_float_kernel, {"W": f"*{t}", "IDX": "*i64", "Y": "*fp32", "k": "i32",
         "BLOCK": "constexpr"}, {"BLOCK": GATHER_BLOCK})
        for t in ("fp32", "fp16", "bf16")
    ],
    ("rows", get_rows_float_kernel, {"W": "*fp32", "IDX": "*i64", "Y": "*fp32", "k": "i32", "BLOCK": "constexpr"},
     {"BLOCK": ROWS_BLOCK}),
    *[
        (f"get_rows_{'q4_0' if q4 else 'q8_0'}", get_rows_quant_kernel,
         {"W8": "*i8", "W16": "*i16", "IDX": "*i64", "Y": "*fp32", "k": "i32", "row_bytes": "i32",
          "Q4": "constexpr", "BLOCK": "constexpr"}, {"Q4": q4, "BLOCK": GATHER_BLOCK})
        for q4 in (False, True)
    ],
    *[
        (f"kv_store_{t}", kv_store_float_kernel, {"X": "*fp32", "CELLS": "*i64", "D": "*i16" if t == "bf16" else f"*{t}",
         "width": "i32", "BF16": "constexpr", "BLOCK": "constexpr"}, {"BF16": t == "bf16", "BLOCK": b})
        for t in ("fp32", "fp16", "bf16") for b in (64, 256, 1024)
    ],
    *[
        ("kv_store_q8_0", kv_store_q8_0_kernel, {"X": "*fp32", "CELLS": "*i64", "D8": "*i8", "D16": "*i16",
         "width": "i32", "row_bytes": "i32", "NB": "constexpr"}, {"NB": nb}, EXACT)
        for nb in (1, 2, 4, 8)
    ],
]  # fmt: skip
