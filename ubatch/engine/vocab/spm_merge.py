"""llama.cpp's SPM merge loop (llm_tokenizer_spm_session::tokenize) in pure Python.

The tokenizer normally runs this loop inside `sentencepiece`; this copy stays for vocabularies
sentencepiece cannot express (no byte tokens, no unknown token), and as the readable statement
of what the fast path must reproduce: repeatedly merge the adjacent pair whose joined text is a
token with the best score (leftmost on ties), then fall back to byte tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from ubatch.engine.vocab.tables import SPM_SPACE

_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)  # llama.cpp's unicode_len_utf8, by high nibble


def spm_merge(
    text: str, token_id: Callable[[str], int | None], scores: np.ndarray, byte_token: Callable[[int], int]
) -> list[int]:
    """The token ids of one raw fragment (no special tokens in it); `token_id` is the vocabulary's
    text -> id lookup (None: not a token). Surrogate escapes in `text` stand for bytes that are not
    UTF-8: llama.cpp's loop then runs on the raw bytes, a symbol being as long as its lead byte says."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return _merge(_byte_symbols(text.encode("utf-8", "surrogateescape")), token_id, scores, byte_token)
    return _merge(list(text.replace(" ", SPM_SPACE)), token_id, scores, byte_token)  # symbols: single chars


def _byte_symbols(raw: bytes) -> list[str]:
    """llama.cpp's symbols of raw bytes, as str (bytes that are not UTF-8 as surrogate escapes)."""
    raw = raw.replace(b" ", SPM_SPACE.encode())
    out, i = [], 0
    while i < len(raw):
        n = min(_UTF8_LEN[raw[i] >> 4], len(raw) - i)
        out.append(raw[i : i + n].decode("utf-8", "surrogateescape"))
        i += n
    return out


def _merge(
    sym: list[str], token_id: Callable[[str], int | None], scores: np.ndarray, byte_token: Callable[[int], int]
) -> list[int]:
    end = len(sym)
    nxt, prv = list(range(1, end + 1)), list(range(-1, end - 1))
    heap: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right < end and (tok := token_id(sym[left] + sym[right])) is not None:
            size = len(sym[left]) + len(sym[right])
            heapq.heappush(heap, (-float(scores[tok]), left, right, size))  # best score, leftmost

    for i in range(1, end):
        push(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue  # stale: a side was merged since this pair was queued
        sym[left], sym[right] = sym[left] + sym[right], ""
        nxt[left] = nxt[right]
        if nxt[right] < end:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    out, i = [], 0
    while i < end:
        tok = token_id(sym[i])
        out.extend([tok] if tok is not None else [byte_token(b) for b in sym[i].encode("utf-8", "surrogateescape")])
        i = nxt[i]
    return out
