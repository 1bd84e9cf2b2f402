"""Code points as llama.cpp's unicode.cpp classifies them, vectorised with numpy.

The pre-tokenisers' regexes see each code point through llama.cpp's tables (unicode_data.py, a
newer Unicode than Python's `unicodedata`), so a letter here is a letter there. Text arrives as
str; lone surrogates standing for undecodable bytes (surrogateescape) are decoded again the way
llama.cpp decodes raw UTF-8 (each bad byte one U+FFFD), so its ids are ours for any bytes.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ubatch.engine.vocab import unicode_data

UNDEFINED, NUMBER, LETTER, SEPARATOR, ACCENT_MARK, PUNCTUATION, SYMBOL, CONTROL = (1 << i for i in range(8))
WHITESPACE = 0x100
MAX_CODEPOINTS = 0x110000
# llama.cpp's "collapsed" text: a non-ASCII code point becomes one byte naming its category
COLLAPSED = {NUMBER: 0xD1, LETTER: 0xD2, PUNCTUATION: 0xD3, ACCENT_MARK: 0xD4, SYMBOL: 0xD5}
COLLAPSED_OTHER, COLLAPSED_SPACE = 0xD0, 0x0B


def _rows(table: str) -> list[list[int]]:
    return [[int(x, 16) for x in row.split(":")] for row in table.split()]


@cache
def flags() -> np.ndarray:
    """uint16 flags of every code point (category bit | WHITESPACE); 2 MiB, built once."""
    rows = np.array(_rows(unicode_data.FLAGS), np.int64)
    table = np.repeat(rows[:-1, 1].astype(np.uint16), np.diff(rows[:, 0]))
    table[[r[0] for r in _rows(unicode_data.WHITESPACE)]] |= WHITESPACE
    return table


@cache
def _collapse_table() -> np.ndarray:
    """Code point -> its byte in llama.cpp's collapsed text (ASCII kept as is)."""
    f = flags()
    out = np.full(MAX_CODEPOINTS, COLLAPSED_OTHER, np.uint8)
    for flag, byte in COLLAPSED.items():
        out[(f & 0xFF) == flag] = byte
    out[(f & WHITESPACE) != 0] = COLLAPSED_SPACE
    out[:128] = np.arange(128)
    return out


@cache
def lowercase() -> dict[int, int]:
    return {a: b for a, b in _rows(unicode_data.LOWERCASE)}


@cache
def lower_table() -> np.ndarray:
    """unicode_tolower for every code point, as one lookup array."""
    out = np.arange(MAX_CODEPOINTS, dtype=np.uint32)
    pairs = np.array(_rows(unicode_data.LOWERCASE), np.uint32).reshape(-1, 2)
    out[pairs[:, 0]] = pairs[:, 1]
    return out


@cache
def nfd() -> np.ndarray:
    """llama.cpp's one-code-point NFD: each code point to the first of its decomposition."""
    out = np.arange(MAX_CODEPOINTS, dtype=np.uint32)
    for first, last, to in _rows(unicode_data.NFD):
        out[first : last + 1] = to
    return out


def codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)


def collapse(text: str) -> str:
    """`text` with every non-ASCII code point replaced by its category byte (whitespace 0x0B)."""
    if text.isascii():
        return text
    return _collapse_table()[codepoints(text)].tobytes().decode("latin-1")


HAN_BLOCKS = (  # unicode_cpt_is_han
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0x2CEB0, 0x2EBEF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)
HAN_LETTER, HAN_OTHER = 0xD6, 0xD7


@cache
def _han_table() -> np.ndarray:
    out = _collapse_table().copy()
    for a, b in HAN_BLOCKS:
        out[a : b + 1] = np.where((flags()[a : b + 1] & LETTER) != 0, HAN_LETTER, HAN_OTHER)
    return out


def collapse_han(text: str) -> str:
    """The collapsed text with the Han blocks' code points told apart (Kimi K2's splitter)."""
    if text.isascii():
        return text
    return _han_table()[codepoints(text)].tobytes().decode("latin-1")


def wide_text(text: str) -> str:
    """`text` as llama.cpp's std::wregex sees it: non-ASCII whitespace becomes 0x0B."""
    if text.isascii():
        return text
    cps = codepoints(text).copy()
    cps[(cps > 0x7F) & ((flags()[cps] & WHITESPACE) != 0)] = COLLAPSED_SPACE
    return cps.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")


def llama_text(text: str) -> str:
    """`text` with surrogate-escaped bytes decoded as llama.cpp decodes raw UTF-8
    (unicode_cpts_from_utf8): a bad byte is one U+FFFD; overlong forms and surrogates pass."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    raw = text.encode("utf-8", "surrogateescape" if _escaped_only(text) else "surrogatepass")
    out, i, n = [], 0, len(raw)
    while i < n:
        b = raw[i]
        size = 1 if b < 0x80 else 0 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 0
        if size == 1:
            out.append(b)
        elif size and i + size <= n and all(raw[i + k] & 0xC0 == 0x80 for k in range(1, size)):
            cp = b & (0xFF >> (size + 1))
            for k in range(1, size):
                cp = cp << 6 | raw[i + k] & 0x3F
            out.append(cp if cp < MAX_CODEPOINTS else 0xFFFD)
        else:
            out.append(0xFFFD)
            size = 1
        i += size
    return np.array(out, "<u4").tobytes().decode("utf-32-le", "surrogatepass")


def _escaped_only(text: str) -> bool:
    """Every surrogate in `text` is a surrogateescape byte (U+DC80..U+DCFF)."""
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in text)


def utf8(text: str) -> bytes:
    """UTF-8 as llama.cpp writes a code point (surrogates as their 3-byte form)."""
    return text.encode("utf-8", "surrogatepass")


def utf8_lengths(words: list[str]) -> tuple[str, np.ndarray]:
    """The words joined, and each one's length in UTF-8 bytes as utf8() writes it, with numpy:
    one pass over the joined code points rather than an encode per word."""
    joined = "".join(words)
    counts = np.fromiter(map(len, words), np.int64, len(words))
    if joined.isascii() or not len(words):
        return joined, counts
    if not counts.all():  # (reduceat needs no empty word)
        return joined, np.fromiter((len(utf8(w)) for w in words), np.int64, len(words))
    cps = codepoints(joined)
    size = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    return joined, np.add.reduceat(size, np.cumsum(counts) - counts)
