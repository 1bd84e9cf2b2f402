"""DRY ("don't repeat yourself"), llama.cpp's sequence-aware repetition penalty.

A token that would extend a run already seen earlier in the last `dry_penalty_last_n` tokens
loses multiplier * base^(run length - allowed length) from its logit. Sequence breakers (text
such as "\\n" or ":") cut the run short: a breaker in the recent history limits how far back a
run may reach, and a token that is a breaker on its own is never penalised. Breakers are text,
so they are matched against every token's piece once per vocabulary (and breaker list) and
kept: a token whose piece holds the breaker is a breaker by itself; one whose piece ends with
the breaker's start is the head of a breaker that the tokens of the remaining text complete.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from ubatch.engine.sampling.stages import Cands

if TYPE_CHECKING:
    from ubatch.engine.vocab.vocab import Vocab

MAX_CHAR_LEN = 40  # breaker bytes kept
MAX_SEQ_LEN = 20  # tail tokens kept
FLOAT_MAX_LOG = np.float32(88.7228391)

Breakers = dict[int, list[tuple[int, ...]]]  # head token -> the token tails that complete it
# per vocabulary, kept while it lives: every token's piece, and the table of each breaker list
_pieces_cache: weakref.WeakKeyDictionary[Vocab, list[bytes]] = weakref.WeakKeyDictionary()
_tables: weakref.WeakKeyDictionary[Vocab, dict[tuple[str, ...], Breakers]] = weakref.WeakKeyDictionary()


def _pieces(vocab: Vocab) -> list[bytes]:
    """Each token's text as llama_detokenize gives it for that token alone (specials shown)."""
    out = _pieces_cache.get(vocab)
    if out is None:
        out = [vocab.token_to_piece(t, special=True) for t in range(vocab.n_tokens)]
        if vocab.add_space_prefix:
            out = [p[1:] if p.startswith(b" ") else p for p in out]
        _pieces_cache[vocab] = out
    return out


def breaker_table(vocab: Vocab | None, breakers: tuple[str, ...]) -> Breakers:
    """get_overlapping_token_sequences for every breaker, cached per vocabulary."""
    if vocab is None or not breakers:
        return {}
    per = _tables.setdefault(vocab, {})
    if breakers in per:
        return per[breakers]
    pieces = _pieces(vocab)
    table: Breakers = {}

    def add(tok: int, tail: tuple[int, ...]) -> None:
        tails = table.setdefault(tok, [])
        if tail not in tails:
            tails.append(tail)

    for text in breakers:
        b = text.encode()[:MAX_CHAR_LEN]
        if not b:
            continue
        tails = [  # the tokens completing the breaker after its first k bytes
            tuple(vocab.tokenize(b[k:].decode("utf-8", errors="replace"), add_special=False)[:MAX_SEQ_LEN])
            for k in range(len(b))
        ]
        for tok, w in enumerate(pieces):
            if b[:1] not in w:
                continue
            if b in w:
                add(tok, ())
                continue
            for k in range(min(len(b) - 1, len(w)), 0, -1):  # longest overlap first, as pos grows
                if w.endswith(b[:k]):
                    add(tok, tails[k])
    per[breakers] = table
    return table


class Dry:
    def __init__(
        self, multiplier: float, base: float, allowed_length: int, last_n: int | None, breakers: Breakers
    ) -> None:
        """`last_n` None: the whole history."""
        self.multiplier, self.base = np.float32(multiplier), np.float32(base)
        self.allowed, self.last_n, self.breakers = allowed_length, last_n, breakers
        self.history: deque[int] = deque(maxlen=last_n)
        self.max_exponent = int(FLOAT_MAX_LOG / np.log(self.base)) if self.base > np.float32(1.000001) else 0

    def accept(self, token: int) -> None:
        self.history.append(token)

    def _rep_limit(self, rev: list[int]) -> int:
        """How far back a run may reach: up to the most recent complete breaker."""
        for i, tok in enumerate(rev):
            tails = self.breakers.get(tok)
            if tails is None:
                continue
            longest = -1
            for tail in tails:
                n = len(tail)
                if longest < n <= i and all(tail[o] == rev[i - o - 1] for o in range(n)):
                    longest = n
            if longest >= 0:
                return i - longest
        return len(rev)

    def _repeat_counts(self, rev: list[int], rep_limit: int) -> list[int]:
        """Z-algorithm over the reversed history: for each position, how long a suffix of the
        history also ends there (capped at rep_limit); the position is counted from the front."""
        n = len(rev)
        last, lt, rt = n - 1, 0, 0
        count = [0] * n
        for k in range(1, n):
            if k > rt:
                m = 0
                while m + k < n and rev[m] == rev[m + k]:
                    m += 1
                count[last - k] = min(m, rep_limit)
                if m > 0:
                    lt, rt = k, k + m - 1
            elif count[last - (k - lt)] < rt - k + 1:
                count[last - k] = min(count[last - (k - lt)], rep_limit)
            else:
                i = rt + 1
                while i < n and rev[i] == rev[i - k]:
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
        return count

    def penalties(self) -> dict[int, float] | None:
        """The logit penalty of each token that would extend a repeat; None when the history
        is too short for any (llama.cpp then leaves the candidates as they are)."""
        hist = list(self.history)
        n = len(hist) if self.last_n is None else min(len(hist), self.last_n)
        if n <= self.allowed:
            return None
        rev = hist[::-1][:n]  # rev[i]: the i-th most recent token
        rep_limit = self._rep_limit(rev)
        if rep_limit < self.allowed:
            return None
        count = self._repeat_counts(rev, rep_limit)
        longest: dict[int, int] = {}
        for i in range(n - 1):
            if count[i] >= self.allowed:
                tok = rev[n - 2 - i]  # the token that followed that earlier occurrence
                if longest.get(tok, -1) < count[i]:
                    longest[tok] = count[i]
        out = {}
        for tok, length in longest.items():
            if any(not tail for tail in self.breakers.get(tok, ())):
                continue  # a breaker by itself is never penalised
            exp = length - self.allowed
            if self.max_exponent > 0 and exp > self.max_exponent:
                exp = self.max_exponent
            out[tok] = float(np.float32(float(self.multiplier) * math.pow(float(self.base), exp)))
        return out

    def __call__(self, c: Cands) -> Cands:
        pen = self.penalties()
        if pen is None:
            return c
        x = c.logits
        if pen:
            pos, vals = c.locate(pen)
            x = x.clone()
            x[pos] -= vals
        return Cands(x, c.ids, False)
