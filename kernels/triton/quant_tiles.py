"""Triton device functions that dequantise weight elements straight from the GGUF blocks.

Every function is element-wise over broadcast index tensors: `rb` is the byte offset of each
element's weight row (int64), `k` the element's column (int32), `mask` which elements exist. The
same functions therefore build a [BLOCK_N, BLOCK_K] tile (GEMV) or a [BLOCK_K, BLOCK_N] tile
(tl.dot) depending only on how the caller broadcasts `rb` and `k`. Each element computes the byte
addresses of its quant bits and scales; neighbouring elements share bytes, which the hardware
merges within a warp, so DRAM traffic stays the block bytes themselves.

Two views of the same bytes come in: `wq` (uint8) and `wh` (int16). Every block size and every
f16 field offset is even, so an f16 field is one aligned 16-bit load (`wh[off // 2]`), where a
32-bit view would be misaligned (a Q4_0 block is 18 bytes). Layouts and the order of the float
operations follow kernels/dequant.py, the reference these tiles are tested against.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ggml type ids (gguf's GGMLQuantizationType), spelled out: constexpr branches compare literals.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30


@triton.jit
def _f16(wh, off, mask):
    """The little-endian f16 at even byte offset `off`, as f32."""
    v = tl.load(wh + (off >> 1), mask=mask, other=0)
    return v.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u8(wq, off, mask):
    return tl.load(wq + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(wq, off, mask):
    return tl.load(wq + off, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(wq, blk, e, base, mask):
    """32-element block layout: element e is the low nibble of byte e % 16, then the high ones."""
    return (_u8(wq, blk + base + (e % 16), mask) >> ((e // 16) * 4)) & 15


@triton.jit
def _q5_bit(wq, blk, base, e, mask):
    """Q5_0/Q5_1 5th bit of element e: bit e % 8 of byte e // 8 of the 32-bit qh field."""
    return (_u8(wq, blk + base + (e // 8), mask) >> (e % 8)) & 1


@triton.jit
def _q8_0(wq, wh, rb, k, mask):
    blk = rb + (k // 32) * 34
    return _f16(wh, blk, mask) * _i8(wq, blk + 2 + (k % 32), mask)


@triton.jit
def _q4_0(wq, wh, rb, k, mask):
    blk = rb + (k // 32) * 18
    q = _nibble(wq, blk, k % 32, 2, mask) - 8
    return _f16(wh, blk, mask) * q.to(tl.float32)


@triton.jit
def _q4_1(wq, wh, rb, k, mask):
    blk = rb + (k // 32) * 20
    q = _nibble(wq, blk, k % 32, 4, mask)
    return _f16(wh, blk, mask) * q.to(tl.float32) + _f16(wh, blk + 2, mask)


@triton.jit
def _q5_0(wq, wh, rb, k, mask):
    blk = rb + (k // 32) * 22
    e = k % 32
    q = (_nibble(wq, blk, e, 6, mask) | (_q5_bit(wq, blk, 2, e, mask) << 4)) - 16
    return _f16(wh, blk, mask) * q.to(tl.float32)


@triton.jit
def _q5_1(wq, wh, rb, k, mask):
    blk = rb + (k // 32) * 24
    e = k % 32
    q = _nibble(wq, blk, e, 8, mask) | (_q5_bit(wq, blk, 4, e, mask) << 4)
    return _f16(wh, blk, mask) * q.to(tl.float32) + _f16(wh, blk + 2, mask)


@triton.jit
def _k_scale_min(wq, blk, j, mask):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 bytes at offset 4."""
    a = _u8(wq, blk + 4 + j + 4, mask)  # s[j + 4]
    b = _u8(wq, blk + 4 + j, mask)  # s[j]
    c = _u8(wq, blk + 4 + (j % 4), mask)  # s[j - 4] for j >= 4
    low = j < 4
    sc = tl.where(low, b & 63, (a & 15) | ((c >> 6) << 4))
    mn = tl.where(low, a & 63, (a >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4_k(wq, wh, rb, k, mask):
    blk = rb + (k // 256) * 144
    e = k % 256
    j = e // 32
    sc, mn = _k_scale_min(wq, blk, j, mask)
    q = (_u8(wq, blk + 16 + (j // 2) * 32 + (e % 32), mask) >> ((j % 2) * 4)) & 15
    return (_f16(wh, blk, mask) * sc) * q.to(tl.float32) - _f16(wh, blk + 2, mask) * mn


@triton.jit
def _q5_k(wq, wh, rb, k, mask):
    blk = rb + (k // 256) * 176
    e = k % 256
    j = e // 32
    l = e % 32  # noqa: E741
    sc, mn = _k_scale_min(wq, blk, j, mask)
    lo = (_u8(wq, blk + 48 + (j // 2) * 32 + l, mask) >> ((j % 2) * 4)) & 15
    hi = (_u8(wq, blk + 16 + l, mask) >> j) & 1
    q = lo | (hi << 4)
    return (_f16(wh, blk, mask) * sc) * q.to(tl.float32) - _f16(wh, blk + 2, mask) * mn


@triton.jit
def _q6_k(wq, wh, rb, k, mask):
    blk = rb + (k // 256) * 210
    e = k % 256
    g = e // 32
    l = e % 32  # noqa: E741
    lo = (_u8(wq, blk + (g // 4) * 64 + (g % 2) * 32 + l, mask) >> (((g // 2) % 2) * 4)) & 15
    hi = (_u8(wq, blk + 128 + (g // 4) * 32 + l, mask) >> ((g % 4) * 2)) & 3
    q = (lo | (hi << 4)) - 32
    sc = _i8(wq, blk + 192 + e // 16, mask)
    return (_f16(wh, blk + 208, mask) * sc) * q.to(tl.float32)


@triton.jit
def _u16(wh, idx, mask):
    return tl.load(wh + idx, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _float(wh, rb, k, mask, TYPE: tl.constexpr):
    """F16 / BF16 / F32 elements through the 16-bit view (2-byte alignment is all they need)."""
    h = rb >> 1  # row start in 16-bit units
    if TYPE == 1:
        w = _f16(wh, rb + 2 * k, mask)
    elif TYPE == 30:
        w = (_u16(wh, h + k, mask) << 16).to(tl.float32, bitcast=True)
    else:
        w = (_u16(wh, h + 2 * k, mask) | (_u16(wh, h + 2 * k + 1, mask) << 16)).to(tl.float32, bitcast=True)
    return w


@triton.jit
def weight_tile(wq, wh, rb, k, mask, TYPE: tl.constexpr):
    """Dequantised f32 weights at (row byte offset rb, column k); 0 where `mask` is false."""
    if TYPE == 8:
        w = _q8_0(wq, wh, rb, k, mask)
    elif TYPE == 2:
        w = _q4_0(wq, wh, rb, k, mask)
    elif TYPE == 3:
        w = _q4_1(wq, wh, rb, k, mask)
    elif TYPE == 6:
        w = _q5_0(wq, wh, rb, k, mask)
    elif TYPE == 7:
        w = _q5_1(wq, wh, rb, k, mask)
    elif TYPE == 12:
        w = _q4_k(wq, wh, rb, k, mask)
    elif TYPE == 13:
        w = _q5_k(wq, wh, rb, k, mask)
    elif TYPE == 14:
        w = _q6_k(wq, wh, rb, k, mask)
    else:
        w = _float(wh, rb, k, mask, TYPE)
    return tl.where(mask, w, 0.0)
