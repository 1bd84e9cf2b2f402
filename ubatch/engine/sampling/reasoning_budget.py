"""llama.cpp's reasoning budget (common/reasoning-budget.cpp): a sampler stage that caps the
tokens a model spends inside its thinking block.

It watches the generated tokens for the template's thinking start tag (the generation prompt's
tokens are fed first, so a template that opens thinking itself starts it counting), counts the
tokens inside the block, and once the budget is spent forces the end: the budget message, if
any, then the first end tag, one token per step (every other logit -inf), after which sampling
is free again. A natural end tag stops the count; a new start tag re-arms it with a fresh
budget. The end is not forced in the middle of a character: when the last counted token leaves
a UTF-8 sequence open, tokens run on until the text ends a character (judged on the text's last
bytes, where llama.cpp looks at one token's piece, so byte tokens that finish a character count).

The stage sees token ids only; the HTTP layer tokenizes the tags and the message (as
llama-server's request schema does) and hands them over in `SamplerParams`.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ubatch.engine.vocab.vocab import Vocab


class BudgetState(StrEnum):
    IDLE = "idle"  # outside thinking: watching for a start tag
    COUNTING = "counting"  # inside thinking: spending the budget, watching for an end tag
    WAITING_UTF8 = "waiting-utf8"  # spent, but the last token left a character open
    FORCING = "forcing"  # writing the forced tokens, one per step
    DONE = "done"  # the block ended: free until a new start tag


class TokenMatcher:
    """Which of several token sequences ends at the latest token (the longest one), over the
    tokens since the last match: after a match, matching starts afresh."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        unique: list[tuple[int, ...]] = []
        for s in seqs:
            t = tuple(s)
            if t and t not in unique:
                unique.append(t)
        self.seqs = unique
        self._keep = max((len(s) for s in unique), default=0)
        self._tail: list[int] = []

    def advance(self, token: int) -> int:
        """Feed one token; the index of the longest sequence it completes, or -1."""
        if not self.seqs:
            return -1
        self._tail.append(token)
        if len(self._tail) > self._keep:
            del self._tail[0]
        best = -1
        for i, s in enumerate(self.seqs):
            n = len(s)
            if n <= len(self._tail) and tuple(self._tail[-n:]) == s and (best < 0 or n > len(self.seqs[best])):
                best = i
        if best >= 0:
            self._tail.clear()
        return best

    def reset(self) -> None:
        self._tail.clear()


def utf8_complete(text: bytes) -> bool:
    """Do these bytes end on a whole character? (Continuation bytes alone do not.)"""
    if not text:
        return True
    for i in range(1, min(4, len(text)) + 1):
        c = text[-i]
        if c & 0xC0 != 0x80:
            need = 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1
            return i >= need
    return False


class ReasoningBudget:
    """One generation's budget state. `apply` constrains a logits row (only while forcing);
    `accept` takes each generated token (and, before generating, the generation prompt's)."""

    def __init__(
        self,
        budget: int,
        start: Sequence[int],
        ends: Sequence[Sequence[int]],
        forced: Sequence[int],
        vocab: Vocab | None = None,
    ) -> None:
        self.budget = budget
        self.remaining = budget
        self.start = TokenMatcher([start])
        self.end = TokenMatcher(ends)
        self.forced = tuple(forced)
        self.vocab = vocab  # for the UTF-8 check; without it every token ends a character
        self.state = BudgetState.IDLE
        self.force_pos = 0
        self.n_forced = 0  # tokens this budget has forced, over the whole generation
        self._bytes = b""  # the last bytes of the thinking text: a character may span tokens

    @property
    def forcing(self) -> int | None:
        """The token this step must produce, or None when sampling is free."""
        if self.state is BudgetState.FORCING and self.force_pos < len(self.forced):
            return self.forced[self.force_pos]
        return None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The row as the chain should see it: unchanged, or while forcing every logit but the
        forced token's at -inf (a forced token the biases sank to -inf is kept, at 0)."""
        tok = self.forcing
        if tok is None:
            return x
        out = torch.full_like(x, float("-inf"))
        v = float(x[tok])
        out[tok] = v if v > float("-inf") else 0.0
        return out

    def _open(self) -> None:
        """A start tag: count a fresh budget (an empty one forces at once)."""
        self.remaining, self._bytes = self.budget, b""
        self.end.reset()
        self.state = BudgetState.COUNTING
        if self.remaining <= 0:
            self._force()

    def _force(self) -> None:
        """The budget is spent: force the sequence (with none, the block is simply left)."""
        self.state = BudgetState.FORCING if self.forced else BudgetState.DONE
        self.force_pos = 0
        self.end.reset()

    def _ends_character(self, token: int) -> bool:
        """Does the thinking text end on a whole character after this token? Judged on the
        text's last bytes, not the piece alone, so byte tokens that finish a character count."""
        if self.vocab is None:
            return True
        self._bytes = (self._bytes + self.vocab.token_to_piece(token))[-4:]
        return utf8_complete(self._bytes)

    def accept(self, token: int) -> None:
        s = self.state
        if s in (BudgetState.IDLE, BudgetState.DONE):
            if self.start.advance(token) >= 0:
                self._open()
            return
        if s is BudgetState.FORCING:
            # The generated token is the forced one (the row allowed nothing else). A token of
            # the generation prompt that is not (the prompt went on after its start tag) leaves
            # the forced sequence where it is, so a budget of 0 still ends the block.
            if token != self.forced[self.force_pos]:
                return
            self.force_pos += 1
            self.n_forced += 1
            if self.force_pos >= len(self.forced):
                self.state = BudgetState.DONE
                self.start.reset()
            return
        if self.end.advance(token) >= 0:  # COUNTING or WAITING_UTF8: the model closed the block
            self.state = BudgetState.DONE
            self.start.reset()
            return
        whole = self._ends_character(token)
        if s is BudgetState.WAITING_UTF8:
            if whole:
                self._force()
            return
        self.remaining -= 1
        if self.remaining <= 0:
            if whole:
                self._force()
            else:
                self.state = BudgetState.WAITING_UTF8
                self.end.reset()
