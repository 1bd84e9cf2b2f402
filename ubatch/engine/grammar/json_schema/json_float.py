"""Doubles printed the way nlohmann::json prints them (llama.cpp's JSON library).

A schema's `const`/`enum` numbers end up as grammar literals, so their text must be
llama.cpp's: nlohmann uses Grisu2, which usually gives the shortest round-tripping digits but
not always (731.15231 prints as 731.1523100000001), so Python's repr() is not enough. This is
Grisu2 (Loitsch 2010) with nlohmann's parameters: 64-bit significands, a cached power of ten
every 8 decimal exponents, alpha = -60, gamma = -32, then printf("%g")-like layout.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from functools import cache

_ALPHA = -60
_MIN_DEC_EXP, _DEC_STEP, _N_POWERS = -300, 8, 79
_MASK64 = (1 << 64) - 1


@cache
def _cached_power(index: int) -> tuple[int, int, int]:
    """(f, e, k) with f * 2^e the 64-bit normalised value of 10^k rounded to nearest."""
    k = _MIN_DEC_EXP + _DEC_STEP * index
    value = Fraction(10) ** k
    e = value.numerator.bit_length() - value.denominator.bit_length() - 64
    while value >= Fraction(2) ** (e + 64):
        e += 1
    while value < Fraction(2) ** (e + 63):
        e -= 1
    f = round(value / Fraction(2) ** e)
    if f >> 64:
        f, e = f >> 1, e + 1
    return f, e, k


def _mul(xf: int, yf: int) -> int:
    """The upper 64 bits of a 64x64-bit product, rounded (ties up)."""
    return ((xf * yf) + (1 << 63)) >> 64


def _normalize(f: int, e: int) -> tuple[int, int]:
    shift = 64 - f.bit_length()
    return (f << shift) & _MASK64, e - shift


def _boundaries(value: float) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """v and the midpoints to its neighbours, normalised to one exponent."""
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    biased, fraction = bits >> 52, bits & ((1 << 52) - 1)
    f, e = (fraction, -1074) if biased == 0 else (fraction + (1 << 52), biased - 1075)
    plus = _normalize(2 * f + 1, e - 1)
    if fraction == 0 and biased > 1:  # the lower neighbour is closer
        minus_f, minus_e = 4 * f - 1, e - 2
    else:
        minus_f, minus_e = 2 * f - 1, e - 1
    minus = (minus_f << (minus_e - plus[1]), plus[1])
    return minus, _normalize(f, e), plus


def _round_down(digits: list[int], dist: int, delta: int, rest: int, ten_k: int) -> None:
    """Move the last digit towards the exact value while the result stays inside the bounds."""
    while rest < dist and delta - rest >= ten_k and (rest + ten_k < dist or dist - rest > rest + ten_k - dist):
        digits[-1] -= 1
        rest += ten_k


def _digit_gen(minus: int, w: int, plus: int, e: int, dec_exp: int) -> tuple[list[int], int]:
    delta, dist, shift = plus - minus, plus - w, -e
    one = 1 << shift
    p1, p2 = plus >> shift, plus & (one - 1)
    n = len(str(p1))
    pow10 = 10 ** (n - 1)
    digits: list[int] = []
    while n > 0:
        digits.append(p1 // pow10)
        p1 %= pow10
        n -= 1
        rest = (p1 << shift) + p2
        if rest <= delta:
            _round_down(digits, dist, delta, rest, pow10 << shift)
            return digits, dec_exp + n
        pow10 //= 10
    m = 0
    while True:
        p2 *= 10
        digits.append(p2 >> shift)
        p2 &= one - 1
        m += 1
        delta *= 10
        dist *= 10
        if p2 <= delta:
            break
    _round_down(digits, dist, delta, p2, one)
    return digits, dec_exp - m


def grisu2(value: float) -> tuple[str, int]:
    """Decimal digits and exponent (value = digits * 10^exponent) for a finite value > 0."""
    (mf, me), (vf, _), (pf, _) = _boundaries(value)
    t = _ALPHA - me - 1
    k = (abs(t) * 78913 >> 18) * (1 if t >= 0 else -1) + (t > 0)  # ceil(t * log10(2)), C's truncation
    cf, ce, ck = _cached_power((-_MIN_DEC_EXP + k + _DEC_STEP - 1) // _DEC_STEP)
    digits, dec_exp = _digit_gen(_mul(mf, cf) + 1, _mul(vf, cf), _mul(pf, cf) - 1, me + ce + 64, -ck)
    return "".join(map(str, digits)), dec_exp


def format_double(x: float) -> str:
    """nlohmann::json's text for a double: exponent form outside 1e-5 .. 1e15, null for nan/inf."""
    if math.isnan(x) or math.isinf(x):
        return "null"
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    if x == 0:
        return sign + "0.0"
    digits, dec_exp = grisu2(abs(x))
    k, n = len(digits), len(digits) + dec_exp  # the decimal point sits n digits in
    if k <= n <= 15:
        return f"{sign}{digits}{'0' * (n - k)}.0"
    if 0 < n <= 15:
        return f"{sign}{digits[:n]}.{digits[n:]}"
    if -4 < n <= 0:
        return f"{sign}0.{'0' * -n}{digits}"
    e = n - 1
    body = digits if k == 1 else f"{digits[0]}.{digits[1:]}"
    return f"{sign}{body}e{'-' if e < 0 else '+'}{abs(e):02d}"
