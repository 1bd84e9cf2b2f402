"""Triton device functions that dequantise weight tiles straight from the GGUF blocks.

A tile is addressed in groups of 32 consecutive elements of a row (every block type is whole
32-element groups: one block of Q4_0..Q8_0, IQ4_NL and MXFP4, one sub-block of the 256-element
K-quants and IQ4_XS):
`rb` is each row's byte offset (int64), `s` the group index along the row (element k = 32 s + ln)
and `ln` the lane 0..31, passed as broadcastable index tensors, e.g. rb [BN, 1, 1], s [1, NS, 1],
ln [1, 1, 32] for a [BN, NS, 32] tile. The caller picks the axis order (GEMV wants rows first,
tl.dot wants k first). Scales, mins and high-bit words are loaded on the [.., NS, 1] shapes, once
per group rather than per element, and the quant bytes of a group are contiguous in `ln`, so the
compiler can load them as vectors where the alignment allows it (Q4_K/Q5_K blocks are multiples
of 16 bytes).

Two views of the same bytes come in: `wq` (uint8) and `wh` (int16). Every block size and every
f16 field offset is even, so an f16 field is one aligned 16-bit load (`wh[off // 2]`), where a
32-bit view would be misaligned (a Q4_0 block is 18 bytes). Layouts and the order of the float
operations follow kernels/quant/dequant.py, the reference these tiles are tested against.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ggml type ids (gguf's GGMLQuantizationType), spelled out: constexpr branches compare literals.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
IQ4_NL, IQ4_XS, MXFP4 = 20, 23, 39
GROUP = 32  # elements per group: the tile's innermost axis


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
def _nibble(wq, qs, ln, mask):
    """32-element block layout at byte `qs`: low nibbles of bytes 0..15, then their high nibbles."""
    return (_u8(wq, qs + (ln % 16), mask) >> ((ln // 16) * 4)) & 15


@triton.jit
def _qh32(wq, off, mask):
    """Q5_0/Q5_1's 32-bit high-bit field at a 2-aligned offset, from its four bytes."""
    return (
        _u8(wq, off, mask)
        | (_u8(wq, off + 1, mask) << 8)
        | (_u8(wq, off + 2, mask) << 16)
        | (_u8(wq, off + 3, mask) << 24)
    )


@triton.jit
def _q8_0(wq, wh, rb, s, ln, mask):
    blk = rb + s * 34
    return _f16(wh, blk, mask) * _i8(wq, blk + 2 + ln, mask)


@triton.jit
def _q4_0(wq, wh, rb, s, ln, mask):
    blk = rb + s * 18
    q = _nibble(wq, blk + 2, ln, mask) - 8
    return _f16(wh, blk, mask) * q.to(tl.float32)


@triton.jit
def _q4_1(wq, wh, rb, s, ln, mask):
    blk = rb + s * 20
    q = _nibble(wq, blk + 4, ln, mask)
    return _f16(wh, blk, mask) * q.to(tl.float32) + _f16(wh, blk + 2, mask)


@triton.jit
def _q5_0(wq, wh, rb, s, ln, mask):
    blk = rb + s * 22
    hi = (_qh32(wq, blk + 2, mask) >> ln) & 1
    q = (_nibble(wq, blk + 6, ln, mask) | (hi << 4)) - 16
    return _f16(wh, blk, mask) * q.to(tl.float32)


@triton.jit
def _q5_1(wq, wh, rb, s, ln, mask):
    blk = rb + s * 24
    hi = (_qh32(wq, blk + 4, mask) >> ln) & 1
    q = _nibble(wq, blk + 8, ln, mask) | (hi << 4)
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
def _q4_k(wq, wh, rb, s, ln, mask):
    blk = rb + (s // 8) * 144
    j = s % 8  # sub-block
    sc, mn = _k_scale_min(wq, blk, j, mask)
    dl = _f16(wh, blk, mask) * sc
    ml = _f16(wh, blk + 2, mask) * mn
    q = (_u8(wq, blk + 16 + (j // 2) * 32 + ln, mask) >> ((j % 2) * 4)) & 15
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q5_k(wq, wh, rb, s, ln, mask):
    blk = rb + (s // 8) * 176
    j = s % 8
    sc, mn = _k_scale_min(wq, blk, j, mask)
    dl = _f16(wh, blk, mask) * sc
    ml = _f16(wh, blk + 2, mask) * mn
    lo = (_u8(wq, blk + 48 + (j // 2) * 32 + ln, mask) >> ((j % 2) * 4)) & 15
    hi = (_u8(wq, blk + 16 + ln, mask) >> j) & 1
    return dl * (lo | (hi << 4)).to(tl.float32) - ml


@triton.jit
def _q6_k(wq, wh, rb, s, ln, mask):
    """Group g = s % 8 of a 256-element block; its two 16-element halves have their own scales."""
    blk = rb + (s // 8) * 210
    g = s % 8
    lo = (_u8(wq, blk + (g // 4) * 64 + (g % 2) * 32 + ln, mask) >> (((g // 2) % 2) * 4)) & 15
    hi = (_u8(wq, blk + 128 + (g // 4) * 32 + ln, mask) >> ((g % 4) * 2)) & 3
    q = (lo | (hi << 4)) - 32
    d = _f16(wh, blk + 208, mask)
    dl = tl.where(ln < 16, d * _i8(wq, blk + 192 + 2 * g, mask), d * _i8(wq, blk + 193 + 2 * g, mask))
    return dl * q.to(tl.float32)


@triton.jit
def _iq4nl_value(q):
    """ggml's kvalues_iq4nl[q] for 4-bit codes, from four int32 words holding its 16 bytes
    (little-endian: code 0 is the low byte of the first word), sign-extended."""
    w = tl.where(q < 4, -1079142271, tl.where(q < 8, -152379953, tl.where(q < 12, 0x26190D01, 0x71594535)))
    b = (w >> ((q & 3) * 8)) & 255
    return (b ^ 128) - 128


@triton.jit
def _e2m1_doubled(q):
    """MXFP4's doubled e2m1 value of a 4-bit code: 0 1 2 3 4 6 8 12, negated where bit 3 is set."""
    m = q & 7
    mag = tl.where(m < 4, m, ((m & 1) + 2) << tl.maximum((m >> 1) - 1, 0))
    return tl.where(q >= 8, -mag, mag)


@triton.jit
def _mxfp4(wq, wh, rb, s, ln, mask):
    """Odd 17-byte blocks: one E8M0 byte (no f16 field), then 16 bytes of codes."""
    blk = rb + s * 17
    e = _u8(wq, blk, mask)
    d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)  # 2^(e - 128)
    return _e2m1_doubled(_nibble(wq, blk + 1, ln, mask)).to(tl.float32) * d


@triton.jit
def _iq4_nl(wq, wh, rb, s, ln, mask):
    blk = rb + s * 18
    return _f16(wh, blk, mask) * _iq4nl_value(_nibble(wq, blk + 2, ln, mask)).to(tl.float32)


@triton.jit
def _iq4_xs(wq, wh, rb, s, ln, mask):
    """Group j = s % 8 of a 136-byte block: 6-bit scale from a nibble of scales_l and two bits of scales_h."""
    blk = rb + (s // 8) * 136
    j = s % 8
    lo = (_u8(wq, blk + 4 + j // 2, mask) >> ((j % 2) * 4)) & 15
    hi = (_u16(wh, (blk + 2) >> 1, mask).to(tl.int32) >> (2 * j)) & 3
    dl = _f16(wh, blk, mask) * ((lo | (hi << 4)) - 32).to(tl.float32)
    return dl * _iq4nl_value(_nibble(wq, blk + 8 + 16 * j, ln, mask)).to(tl.float32)


@triton.jit
def _u16(wh, idx, mask):
    return tl.load(wh + idx, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _float(wh, rb, s, ln, mask, TYPE: tl.constexpr):
    """F16 / BF16 / F32 elements through the 16-bit view (2-byte alignment is all they need)."""
    k = s * 32 + ln
    if TYPE == 1:
        w = _f16(wh, rb + 2 * k, mask)
    elif TYPE == 30:
        w = (_u16(wh, (rb >> 1) + k, mask) << 16).to(tl.float32, bitcast=True)
    else:
        i = (rb >> 1) + 2 * k
        w = (_u16(wh, i, mask) | (_u16(wh, i + 1, mask) << 16)).to(tl.float32, bitcast=True)
    return w


@triton.jit
def weight_groups(wq, wh, rb, s, ln, mask, TYPE: tl.constexpr):
    """Dequantised f32 weights of row offset rb, group s, lane ln (broadcast); 0 where `mask` is false.

    `mask` covers rows and groups (it broadcasts like rb and s); lanes are always in range.
    """
    if TYPE == 8:
        w = _q8_0(wq, wh, rb, s, ln, mask)
    elif TYPE == 2:
        w = _q4_0(wq, wh, rb, s, ln, mask)
    elif TYPE == 3:
        w = _q4_1(wq, wh, rb, s, ln, mask)
    elif TYPE == 6:
        w = _q5_0(wq, wh, rb, s, ln, mask)
    elif TYPE == 7:
        w = _q5_1(wq, wh, rb, s, ln, mask)
    elif TYPE == 12:
        w = _q4_k(wq, wh, rb, s, ln, mask)
    elif TYPE == 13:
        w = _q5_k(wq, wh, rb, s, ln, mask)
    elif TYPE == 14:
        w = _q6_k(wq, wh, rb, s, ln, mask)
    elif TYPE == 39:
        w = _mxfp4(wq, wh, rb, s, ln, mask)
    elif TYPE == 20:
        w = _iq4_nl(wq, wh, rb, s, ln, mask)
    elif TYPE == 23:
        w = _iq4_xs(wq, wh, rb, s, ln, mask)
    else:
        w = _float(wh, rb, s, ln, mask, TYPE)
    return tl.where(mask, w, 0.0)
