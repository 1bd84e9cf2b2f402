"""Token text -> id without a Python object per token: an open-addressing table over the texts'
UTF-8 hashes.

A dict over the 262,144 texts of a Gemma vocabulary costs ~16 MiB of entries plus the str keys
themselves; this table is one int32 array (a token id per slot, 2 MiB) and compares a probe with
the vocabulary's StringArray bytes (length first), so it is as exact as a dict: a text is found
iff it is a token.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ubatch.engine.gguf.string_array import StringArray


class TokenIndex:
    """A read-only mapping from token text to id; `duplicate` is the lowest id whose text a later
    token repeats (None if all differ), which the vocabulary refuses."""

    def __init__(self, texts: StringArray) -> None:
        n = len(texts)
        size = 1 << max(4, (2 * n - 1).bit_length())  # load factor <= 1/2: short probe runs
        blob, off = texts.blob, texts.off
        hashes = np.fromiter((hash(blob[off[i] : off[i + 1]]) for i in range(n)), np.int64, n)
        home = hashes & (size - 1)
        order = np.argsort(home, kind="stable")  # by home slot, then id
        # linear probing laid out in one pass: the k-th key (by home) lands at max(home, previous + 1)
        ranks = np.arange(n)
        at = np.maximum.accumulate(home[order] - ranks) + ranks if n else ranks
        end = max(size, int(at[-1]) + 2 if n else 0)  # probes run past the table (no wrap) to an empty slot
        slots = np.full(end, -1, np.int32)
        slots[at] = order
        self.duplicate = _first_duplicate(texts, hashes)
        self._texts, self._mask, self.slots = texts, size - 1, slots
        self._slot = slots.data.cast("B").cast("i")

    def get(self, text: str, default: int | None = None) -> int | None:
        b = text.encode("utf-8", "surrogatepass")
        n, i, slots = len(b), hash(b) & self._mask, self._slot
        blob, off = self._texts.blob, self._texts.off
        while (tok := slots[i]) >= 0:
            a = off[tok]
            if off[tok + 1] - a == n and blob[a : a + n] == b:
                return tok
            i += 1
        return default

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and self.get(text) is not None

    def __getitem__(self, text: str) -> int:
        tok = self.get(text)
        if tok is None:
            raise KeyError(text)
        return tok

    def __len__(self) -> int:
        return len(self._texts)

    def __iter__(self) -> Iterator[str]:
        return iter(self._texts)


def _first_duplicate(texts: StringArray, hashes: np.ndarray) -> int | None:
    """The lowest id whose text a later token repeats: equal texts have equal hashes."""
    order = np.argsort(hashes, kind="stable")
    hs = hashes[order]
    runs: dict[int, list[int]] = {}  # equal hashes (equal texts, or a rare collision)
    for k in np.flatnonzero(hs[1:] == hs[:-1]).tolist():
        runs.setdefault(int(hs[k]), []).extend((int(order[k]), int(order[k + 1])))
    piece = texts.piece
    twins = [i for ids in runs.values() for i in ids for j in ids if i < j and piece(i) == piece(j)]
    return min(twins, default=None)
