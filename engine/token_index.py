"""Token text -> id without a Python object per token: an open-addressing table over str hashes.

A dict over the 262,144 texts of a Gemma vocabulary costs ~16 MiB of entries plus the str keys
themselves; this table is two numpy arrays (a token id per slot, a hash per token, ~6 MiB) and
reads texts back from the vocabulary's StringArray only to confirm a hash match. Lookups take the
string's own hash(), so they are as exact as a dict's: a text is found iff it is a token.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .string_array import StringArray


class TokenIndex:
    """A read-only mapping from token text to id (a duplicate text is the vocabulary's error)."""

    def __init__(self, texts: StringArray) -> None:
        n = len(texts)
        size = 1 << max(4, (2 * n - 1).bit_length())  # load factor <= 1/2: short probe runs
        self._texts, self._mask = texts, size - 1
        self.hashes = np.fromiter((hash(t) for t in texts), np.int64, n)
        slots = np.full(size, -1, np.int32)
        home = self.hashes & self._mask
        pending, step = np.arange(n, dtype=np.int64), 0
        while pending.size:  # linear probing, placed one probe step at a time for all keys at once
            slot = (home[pending] + step) & self._mask
            free = np.flatnonzero(slots[slot] < 0)
            won_slots, first = np.unique(slot[free], return_index=True)  # lowest id wins a slot
            slots[won_slots] = pending[free[first]]
            placed = np.zeros(pending.size, bool)
            placed[free[first]] = True
            pending, step = pending[~placed], step + 1
        self.slots = slots
        self._slot = memoryview(slots).cast("B").cast("i")
        self._hash = memoryview(self.hashes).cast("B").cast("q")

    def get(self, text: str, default: int | None = None) -> int | None:
        h = hash(text)
        i, mask, slots, hashes = h & self._mask, self._mask, self._slot, self._hash
        blob, off = self._texts.blob, self._texts.off
        while (tok := slots[i]) >= 0:
            if hashes[tok] == h and blob[off[tok] : off[tok + 1]].decode("utf-8", "surrogatepass") == text:
                return tok
            i = (i + 1) & mask
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

    def first_duplicate(self) -> int | None:
        """The lowest id whose text a later token repeats (None if all texts differ)."""
        order = np.argsort(self.hashes, kind="stable")
        hs = self.hashes[order]
        runs: dict[int, list[int]] = {}  # equal hashes (equal texts, or a rare collision)
        for k in np.flatnonzero(hs[1:] == hs[:-1]).tolist():
            runs.setdefault(int(hs[k]), []).extend((int(order[k]), int(order[k + 1])))
        piece = self._texts.piece
        twins = [i for ids in runs.values() for i in ids for j in ids if i < j and piece(i) == piece(j)]
        return min(twins, default=None)
