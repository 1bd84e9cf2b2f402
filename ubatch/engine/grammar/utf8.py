"""UTF-8 as llama.cpp's grammar decodes it: a token may end inside a character (byte tokens),
which is carried to the next token as a partial sequence (value so far, bytes still to come)."""

from __future__ import annotations


def decode_utf8(data: bytes, value: int = 0, n_remain: int = 0) -> tuple[list[int], int, int]:
    """llama.cpp's decode_utf8 with a partial start: (code points, partial value, n_remain).
    It stops at a NUL byte; n_remain -1 means an invalid sequence (the token is rejected)."""
    cps: list[int] = []
    i, n = 0, len(data)
    started = n_remain > 0
    while i < n and data[i] and n_remain > 0:
        if data[i] >> 6 != 2:
            return [], 0, -1
        value, i, n_remain = (value << 6) + (data[i] & 0x3F), i + 1, n_remain - 1
    if started and n_remain == 0:
        cps.append(value)
    while i < n and data[i]:
        n_remain = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)[data[i] >> 4] - 1
        if n_remain < 0:
            return [], 0, -1
        value, i = data[i] & ((1 << (7 - n_remain)) - 1), i + 1
        while i < n and data[i] and n_remain > 0:
            value, i, n_remain = (value << 6) + (data[i] & 0x3F), i + 1, n_remain - 1
        if n_remain == 0:
            cps.append(value)
    return cps, value, n_remain


def partial_range(value: int, n_remain: int) -> tuple[int, int] | None:
    """The code points a partial sequence can still become (None: none, or an overlong one)."""
    if n_remain < 0 or (n_remain == 1 and value < 2):
        return None
    lo = value << (n_remain * 6)
    hi = lo | ((1 << (n_remain * 6)) - 1)
    if lo == 0:
        lo = {2: 1 << 11, 3: 1 << 16}.get(n_remain, lo)
    return lo, hi
