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

Two views of the same bytes come in: `wq` (uint8) and `wh` (int16). Every block size but MXFP4's
(17, no f16 field) and every f16 field offset is even, so an f16 field is one aligned 16-bit load
(`wh[off // 2]`), where a 32-bit view would be misaligned (a Q4_0 block is 18 bytes). The grid
types also read their grid (`gq`, bytes in device memory; iq_grids.py); IQ4_NL/IQ4_XS and MXFP4
compute their 16-value tables in registers. Layouts and the order of the float operations follow
kernels/quant/dequant.py and dequant_iq.py, the reference these tiles are tested against.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ggml type ids (gguf's GGMLQuantizationType), spelled out: constexpr branches compare literals.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
IQ4_NL, IQ4_XS, MXFP4 = 20, 23, 39
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M, TQ1_0, TQ2_0 = 16, 17, 18, 19, 21, 22, 29, 34, 35
# the grid types and the grid each reads (kernels/quant/iq_grids.py; entries of 8 or 4 bytes)
GRID_OF = {IQ2_XXS: "iq2xxs_grid", IQ2_XS: "iq2xs_grid", IQ2_S: "iq2s_grid", IQ3_XXS: "iq3xxs_grid"}
GRID_OF |= {IQ3_S: "iq3s_grid", IQ1_S: "iq1s_grid", IQ1_M: "iq1s_grid"}
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
def _u32(wh, off, mask):
    """The little-endian u32 at even byte offset `off`, from two 16-bit loads."""
    return _u16(wh, off >> 1, mask) | (_u16(wh, (off >> 1) + 1, mask) << 16)


@triton.jit
def _ksign(k, j):
    """Bit j of ggml's ksigns_iq2xs[k]: the 7-bit index k, with the parity of its bits as bit 7."""
    p = k ^ (k >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return ((k | ((p & 1) << 7)) >> j) & 1


@triton.jit
def _signed(v, neg):
    return tl.where(neg != 0, -v, v)


@triton.jit
def _iq2_xxs(wq, wh, gq, rb, s, ln, mask):
    """Per 32 values: four grid indices (a byte each, 8 values per entry), then a u32 of four
    7-bit sign indices and a 4-bit scale."""
    blk = rb + (s // 8) * 66
    q = blk + 2 + 8 * (s % 8)
    grp = ln // 8  # the group of 8 values within 32
    j = ln % 8
    a1 = _u32(wh, q + 4, mask)
    db = _f16(wh, blk, mask) * (0.5 + (a1 >> 28).to(tl.float32)) * 0.25
    g = _u8(gq, _u8(wq, q + grp, mask) * 8 + j, mask)
    return _signed(db * g.to(tl.float32), _ksign((a1 >> (7 * grp)) & 127, j))


@triton.jit
def _iq2_db(d, sc, grp):
    """IQ2_XS/IQ2_S: the scale of group grp (0..3) from its 32 values' scale byte."""
    return d * (0.5 + ((sc >> (4 * (grp // 2))) & 15).to(tl.float32)) * 0.25


@triton.jit
def _iq2_xs(wq, wh, gq, rb, s, ln, mask):
    blk = rb + (s // 8) * 74
    ib = s % 8
    grp = ln // 8
    j = ln % 8
    q = _u16(wh, (blk + 2 + 2 * (4 * ib + grp)) >> 1, mask).to(tl.int32)
    db = _iq2_db(_f16(wh, blk, mask), _u8(wq, blk + 66 + ib, mask), grp)
    g = _u8(gq, (q & 511) * 8 + j, mask)
    return _signed(db * g.to(tl.float32), _ksign(q >> 9, j))


@triton.jit
def _iq2_s(wq, wh, gq, rb, s, ln, mask):
    blk = rb + (s // 8) * 82
    ib = s % 8
    grp = ln // 8
    j = ln % 8
    idx = _u8(wq, blk + 2 + 4 * ib + grp, mask) | ((_u8(wq, blk + 66 + ib, mask) << (8 - 2 * grp)) & 0x300)
    db = _iq2_db(_f16(wh, blk, mask), _u8(wq, blk + 74 + ib, mask), grp)
    g = _u8(gq, idx * 8 + j, mask)
    return _signed(db * g.to(tl.float32), (_u8(wq, blk + 34 + 4 * ib + grp, mask) >> j) & 1)


@triton.jit
def _iq3_xxs(wq, wh, gq, rb, s, ln, mask):
    """Entries of 4 values: lane ln reads index byte ln // 4 of its 32 values' eight."""
    blk = rb + (s // 8) * 98
    ib = s % 8
    aux = _u32(wh, blk + 66 + 4 * ib, mask)
    db = _f16(wh, blk, mask) * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
    g = _u8(gq, _u8(wq, blk + 2 + 8 * ib + ln // 4, mask) * 4 + ln % 4, mask)
    return _signed(db * g.to(tl.float32), _ksign((aux >> (7 * (ln // 8))) & 127, ln % 8))


@triton.jit
def _iq3_s(wq, wh, gq, rb, s, ln, mask):
    blk = rb + (s // 8) * 110
    ib = s % 8
    bi = ln // 4  # the index byte of the lane's entry; its ninth bit is bit bi of qh
    idx = _u8(wq, blk + 2 + 8 * ib + bi, mask) | (((_u8(wq, blk + 66 + ib, mask) >> bi) & 1) << 8)
    sc = (_u8(wq, blk + 106 + ib // 2, mask) >> (4 * (ib % 2))) & 15
    db = _f16(wh, blk, mask) * (1 + 2 * sc).to(tl.float32)
    g = _u8(gq, idx * 4 + ln % 4, mask)
    return _signed(db * g.to(tl.float32), (_u8(wq, blk + 74 + 4 * ib + ln // 8, mask) >> (ln % 8)) & 1)


@triton.jit
def _iq1_value(gq, idx, j, dl, neg_delta, mask):
    """dl * (grid value + delta): the iq1s grid's signed bytes, delta -1/8 where neg_delta."""
    g = (_u8(gq, idx * 8 + j, mask) ^ 128) - 128
    return dl * (g.to(tl.float32) + tl.where(neg_delta != 0, -0.125, 0.125))


@triton.jit
def _iq1_s(wq, wh, gq, rb, s, ln, mask):
    blk = rb + (s // 8) * 50
    ib = s % 8
    grp = ln // 8
    qh = _u16(wh, (blk + 34 + 2 * ib) >> 1, mask).to(tl.int32)
    dl = _f16(wh, blk, mask) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    idx = _u8(wq, blk + 2 + 4 * ib + grp, mask) | (((qh >> (3 * grp)) & 7) << 8)
    return _iq1_value(gq, idx, ln % 8, dl, qh & 0x8000, mask)


@triton.jit
def _iq1_m(wq, wh, gq, rb, s, ln, mask):
    """No f16 field: the block's scale is the top nibbles of the four u16 scale words."""
    blk = rb + (s // 8) * 56
    ib = s % 8
    grp = ln // 8
    sw = (blk + 48) >> 1
    bits = (
        (_u16(wh, sw, mask) >> 12)
        | ((_u16(wh, sw + 1, mask) >> 8) & 0xF0)
        | ((_u16(wh, sw + 2, mask) >> 4) & 0xF00)
        | (_u16(wh, sw + 3, mask) & 0xF000)
    )
    d = bits.to(tl.int32).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    sc = _u16(wh, sw + ib // 2, mask).to(tl.int32)
    dl = d * (2 * ((sc >> (6 * (ib % 2) + 3 * (grp // 2))) & 7) + 1).to(tl.float32)
    h = _u8(wq, blk + 32 + 2 * ib + grp // 2, mask) >> (4 * (grp % 2))
    idx = _u8(wq, blk + 4 * ib + grp, mask) | ((h & 7) << 8)
    return _iq1_value(gq, idx, ln % 8, dl, h & 8, mask)


@triton.jit
def _tq1_0(wq, wh, rb, s, ln, mask):
    """Value L of a block: a base-3 digit of byte L % 32 (L < 160), 32 + (L - 160) % 16 (L < 240)
    or 48 + (L - 240) % 4, the digit's place the quotient; read as ggml does, (q * 3^n mod 256) * 3 >> 8."""
    blk = rb + (s // 8) * 54
    v = 32 * (s % 8) + ln
    first, mid = v < 160, v < 240
    byte = tl.where(first, v % 32, tl.where(mid, 32 + (v - 160) % 16, 48 + (v - 240) % 4))
    n = tl.where(first, v // 32, tl.where(mid, (v - 160) // 16, (v - 240) // 4))
    pow3 = tl.where(n == 0, 1, tl.where(n == 1, 3, tl.where(n == 2, 9, tl.where(n == 3, 27, 81))))
    xi = (((_u8(wq, blk + byte, mask) * pow3) & 255) * 3) >> 8
    return (xi - 1).to(tl.float32) * _f16(wh, blk + 52, mask)


@triton.jit
def _tq2_0(wq, wh, rb, s, ln, mask):
    """2-bit codes: group g of a block reads bytes 32 (g // 4) + ln at shift 2 (g % 4)."""
    blk = rb + (s // 8) * 66
    g = s % 8
    q = (_u8(wq, blk + 32 * (g // 4) + ln, mask) >> (2 * (g % 4))) & 3
    return (q - 1).to(tl.float32) * _f16(wh, blk + 64, mask)


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
def weight_groups(wq, wh, gq, rb, s, ln, mask, TYPE: tl.constexpr):
    """Dequantised f32 weights of row offset rb, group s, lane ln (broadcast); 0 where `mask` is false.
    `gq`: the grid of a grid type (GRID_OF), bytes; any pointer for the others.

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
    elif TYPE == 16:
        w = _iq2_xxs(wq, wh, gq, rb, s, ln, mask)
    elif TYPE == 17:
        w = _iq2_xs(wq, wh, gq, rb, s, ln, mask)
    elif TYPE == 22:
        w = _iq2_s(wq, wh, gq, rb, s, ln, mask)
    elif TYPE == 18:
        w = _iq3_xxs(wq, wh, gq, rb, s, ln, mask)
    elif TYPE == 21:
        w = _iq3_s(wq, wh, gq, rb, s, ln, mask)
    elif TYPE == 19:
        w = _iq1_s(wq, wh, gq, rb, s, ln, mask)
    elif TYPE == 29:
        w = _iq1_m(wq, wh, gq, rb, s, ln, mask)
    elif TYPE == 34:
        w = _tq1_0(wq, wh, rb, s, ln, mask)
    elif TYPE == 35:
        w = _tq2_0(wq, wh, rb, s, ln, mask)
    else:
        w = _float(wh, rb, s, ln, mask, TYPE)
    return tl.where(mask, w, 0.0)
