"""The pushdown matcher over code points: llama.cpp's stacks, with every state interned.

A stack is a tuple of element positions (its top last) that always ends at a terminal (a
character class or a token reference) or is empty (the grammar is complete). A state is the set
of stacks the text so far can be in; the text is rejected when the set becomes empty. States are
interned as ints, and each state's reaction to the next character is computed once as a
partition of the code-point axis into intervals, each leading to one next state: so walking a
token, or a trie of all tokens, costs a bisect per character after the first visit.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np

from ubatch.engine.grammar.elements import (
    ALT,
    CHAR_ALT,
    CHAR_ANY,
    CHAR_NOT,
    CHAR_RNG_UPPER,
    RULE_REF,
    SEQ_END,
    TOKEN_NOT,
    TOKEN_REFS,
    ParsedGrammar,
)
from ubatch.engine.grammar.recursion import check_left_recursion
from ubatch.engine.grammar.utf8 import partial_range

CP_END = 1 << 32  # one past any code point llama.cpp's decoder can produce
DEAD = -1  # the state id of "no stack left": the text is rejected

Stack = tuple[int, ...]


@dataclass(slots=True)
class StateInfo:
    """What one state does with the next character (or token, or end of text)."""

    bounds: list[int]  # interval starts on the code-point axis, bounds[0] == 0
    nexts: list[int]  # the state each interval leads to (DEAD: rejected)
    bounds_np: np.ndarray
    nexts_np: np.ndarray
    accepting: bool  # an empty stack: the text so far is a complete match
    char_tops: tuple[int, ...]  # positions of the character classes on top of the stacks
    token_tops: tuple[tuple[bool, int], ...]  # (negated, token id) of token references on top


class Matcher:
    """A parsed grammar laid out flat, with the interned states reached so far."""

    def __init__(self, g: ParsedGrammar) -> None:
        self.elems: list[tuple[int, int]] = []
        self.starts: list[int] = []
        for rule in g.rules:
            self.starts.append(len(self.elems))
            self.elems.extend(rule)
        check_left_recursion(g)
        self._classes: dict[int, tuple[bool, list[tuple[int, int]], int]] = {}
        self._advanced: dict[Stack, frozenset[Stack]] = {}
        self._ids: dict[frozenset[Stack], int] = {}
        self.states: list[frozenset[Stack]] = []
        self._info: list[StateInfo | None] = []
        self._lock = threading.Lock()
        first: set[Stack] = set()
        for alt in self.alternatives(g.root):
            first |= self.advance(() if self.end_of_seq(alt) else (alt,))
        self.start = self.intern(frozenset(first))

    def end_of_seq(self, pos: int) -> bool:
        return self.elems[pos][0] in SEQ_END

    def alternatives(self, rule_id: int) -> list[int]:
        """The first position of each alternative of a rule."""
        pos, out = self.starts[rule_id], []
        while True:
            out.append(pos)
            while not self.end_of_seq(pos):
                pos += 1
            if self.elems[pos][0] != ALT:
                return out
            pos += 1

    def char_class(self, pos: int) -> tuple[bool, list[tuple[int, int]], int]:
        """(positive, inclusive ranges, the position after the class) of the class at pos."""
        hit = self._classes.get(pos)
        if hit is not None:
            return hit
        el, start = self.elems, pos
        positive, ranges = el[pos][0] != CHAR_NOT, []
        while True:
            if el[pos + 1][0] == CHAR_RNG_UPPER:
                ranges.append((el[pos][1], el[pos + 1][1]))
                pos += 2
            elif el[pos][0] == CHAR_ANY:
                ranges.append((0, CP_END - 1))
                pos += 1
            else:
                ranges.append((el[pos][1], el[pos][1]))
                pos += 1
            if el[pos][0] != CHAR_ALT:
                break
        self._classes[start] = hit = (positive, ranges, pos)
        return hit

    def advance(self, stack: Stack) -> frozenset[Stack]:
        """llama.cpp's advance_stack: expand rule references until every top is a terminal."""
        hit = self._advanced.get(stack)
        if hit is not None:
            return hit
        todo, seen, out = [stack], set(), set()
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            if not cur:
                out.add(cur)
                continue
            kind, value = self.elems[cur[-1]]
            if kind == RULE_REF:
                base = cur[:-1] + ((cur[-1] + 1,) if not self.end_of_seq(cur[-1] + 1) else ())
                for alt in self.alternatives(value):
                    todo.append(base + ((alt,) if not self.end_of_seq(alt) else ()))
            else:
                out.add(cur)
        self._advanced[stack] = hit = frozenset(out)
        return hit

    def intern(self, stacks: frozenset[Stack]) -> int:
        """The state's id; the lock keeps ids and lists aligned when two engine threads (two
        servers in one process) share a compiled grammar. Everything else cached is idempotent."""
        if not stacks:
            return DEAD
        sid = self._ids.get(stacks)
        if sid is None:
            with self._lock:
                sid = self._ids.get(stacks)
                if sid is None:
                    self.states.append(stacks)
                    self._info.append(None)
                    sid = self._ids[stacks] = len(self.states) - 1
        return sid

    def info(self, sid: int) -> StateInfo:
        hit = self._info[sid]
        return hit if hit is not None else self._build_info(sid)

    def _build_info(self, sid: int) -> StateInfo:
        cuts, moves, char_tops, token_tops = {0, CP_END}, [], [], []
        accepting = False
        for stack in self.states[sid]:
            if not stack:
                accepting = True
                continue
            kind, value = self.elems[stack[-1]]
            if kind in TOKEN_REFS:
                token_tops.append((kind == TOKEN_NOT, value))
                continue
            positive, ranges, after = self.char_class(stack[-1])
            rest = stack[:-1] + ((after,) if not self.end_of_seq(after) else ())
            if not positive:  # the complement of the ranges
                ranges = complement(ranges)
            for lo, hi in ranges:
                cuts.update((lo, hi + 1))
            moves.append((ranges, self.advance(rest)))
            char_tops.append(stack[-1])
        bounds = sorted(c for c in cuts if c < CP_END)
        nexts = []
        for b in bounds:
            nxt: set[Stack] = set()
            for ranges, stacks in moves:
                if any(lo <= b <= hi for lo, hi in ranges):
                    nxt |= stacks
            nexts.append(self.intern(frozenset(nxt)))
        info = StateInfo(
            bounds,
            nexts,
            np.asarray(bounds, dtype=np.int64),
            np.asarray(nexts, dtype=np.int64),
            accepting,
            tuple(char_tops),
            tuple(token_tops),
        )
        self._info[sid] = info
        return info

    def step(self, sid: int, cp: int) -> int:
        """The state after one more code point (DEAD if no stack accepts it)."""
        info = self.info(sid)
        return info.nexts[bisect.bisect_right(info.bounds, cp) - 1]

    def after_token(self, sid: int, token: int) -> int:
        """The state after a token reference consumes `token` (DEAD if none matches)."""
        out: set[Stack] = set()
        for stack in self.states[sid]:
            if stack and self.elems[stack[-1]][0] in TOKEN_REFS:
                kind, value = self.elems[stack[-1]]
                if (value == token) != (kind == TOKEN_NOT):
                    rest = stack[:-1] + ((stack[-1] + 1,) if not self.end_of_seq(stack[-1] + 1) else ())
                    out |= self.advance(rest)
        return self.intern(frozenset(out))

    def without_complete(self, sid: int) -> int:
        """The state minus its empty stack: llama.cpp drops a complete stack on any accepted token."""
        stacks = self.states[sid]
        return self.intern(stacks - {()}) if () in stacks else sid

    def char_only(self, sid: int) -> int:
        """The stacks whose top is a character class (those a token's text can advance)."""
        keep = (s for s in self.states[sid] if s and self.elems[s[-1]][0] not in TOKEN_REFS)
        return self.intern(frozenset(keep))

    def union(self, a: int, b: int) -> int:
        if a == DEAD or b == DEAD:
            return b if a == DEAD else a
        return self.intern(self.states[a] | self.states[b])

    def partial_ok(self, sid: int, value: int, n_remain: int) -> bool:
        """Can some completion of a partial UTF-8 sequence satisfy a class on top of a stack?"""
        if n_remain == 0:
            return True
        span = partial_range(value, n_remain)
        if span is None:
            return False
        lo, hi = span
        for pos in self.info(sid).char_tops:
            positive, ranges, _ = self.char_class(pos)
            if any(a <= hi and lo <= b for a, b in ranges) == positive:
                return True
        return False

    def walk(self, sid: int, cps: list[int] | str) -> int:
        """The state after a sequence of code points (DEAD as soon as one is rejected)."""
        for c in cps:
            sid = self.step(sid, c if isinstance(c, int) else ord(c))
            if sid == DEAD:
                break
        return sid


def complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for a, b in sorted(ranges):
        if a > lo:
            out.append((lo, a - 1))
        lo = max(lo, b + 1)
    if lo < CP_END:
        out.append((lo, CP_END - 1))
    return out
