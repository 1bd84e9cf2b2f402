"""The pushdown matcher over code points: llama.cpp's stacks, with every state interned.

A stack is a tuple of element positions (its top last) that always ends at a terminal (a
character class or a token reference) or is empty (the grammar is complete). A state is the set
of stacks the text so far can be in; the text is rejected when the set becomes empty. States are
interned as ints, and each state's reaction to the next character is computed once as a
partition of the code-point axis into intervals, each leading to one next state: so walking a
token, or a trie of all tokens, costs a bisect per character after the first visit.

What a matcher does and keeps is bounded (budget.py): each step and each session counts its
work as it goes (`Work`, one per session and thread), so a state or a step too large for any
sane grammar is a GrammarError while it is being built, not after; the interned states are
dropped once they pass the matcher's budget, or when all live matchers together pass
MAX_TOTAL_ENTRIES. Dropping renumbers states, so it only happens between `session`s: a caller
holds state ids only inside one, and keeps the state's stacks (`states[sid]`) to find its id
again in the next (GrammarSampler does).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ubatch.engine.grammar.budget import (
    MATCHER_ENTRIES_PER_ELEMENT,
    MAX_MATCHER_ENTRIES,
    MAX_STATE_STACKS,
    MAX_TOTAL_ENTRIES,
    PROBE_STEPS,
    Work,
    too_ambiguous,
)
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
        self._lock = threading.Lock()
        self._active = 0  # sessions in progress: states are only dropped when there are none
        self.epoch = 0  # bumped each time the states are dropped (ids change meaning)
        self.entries = 0  # stack entries held in the caches below (budget.py)
        self.last_used = 0
        self._advanced: dict[Stack, frozenset[Stack]] = {}
        first: set[Stack] = set()
        work = Work()
        for alt in self.alternatives(g.root):
            first |= self._expand(() if self.end_of_seq(alt) else (alt,), work)
        self._first = frozenset(first)
        self._drop_states()
        self.start = 0  # the start state keeps id 0 whenever the states are dropped
        _POOL.add(self)

    def probe(self, roots: Sequence[int] = ()) -> None:
        """Walk PROBE_STEPS characters from the start, each time into the largest next state
        not seen yet: where an ambiguous grammar's states grow, so the budget's GrammarError
        comes now (at compile time, for a server) rather than mid-generation. The states built
        stay for the first generation. Then walk from each rule of `roots` too (as if it
        started the text): a repetition of an item that can match nothing (the nested shape,
        ParsedGrammar.ambiguous) is found however much text comes before it."""
        self._walk_from(self.start)
        for rule in roots:
            first: set[Stack] = set()
            for alt in self.alternatives(rule):
                first |= self.advance(() if self.end_of_seq(alt) else (alt,))
            self._walk_from(self.intern(frozenset(first)))

    def _walk_from(self, sid: int) -> None:
        if sid == DEAD:
            return
        seen = {sid}
        for _ in range(PROBE_STEPS):
            nexts = {n for n in self.info(sid).nexts if n != DEAD and n not in seen}
            if not nexts:
                return
            sid = max(nexts, key=lambda n: len(self.states[n]))
            seen.add(sid)

    def _drop_states(self) -> None:
        """Forget every state but the start (the caller holds the lock, or is __init__)."""
        self._advanced = {}
        self.states: list[frozenset[Stack]] = [self._first]
        self._ids: dict[frozenset[Stack], int] = {self._first: 0}
        self._info: list[StateInfo | None] = [None]
        self.entries = len(self._first) + 1
        self.epoch += 1

    @contextmanager
    def session(self, probing: bool = False) -> Iterator[None]:
        """A span in which state ids stay valid, and whose work is counted as one (budget.py
        `Work`, with its CPU-time limit when `probing`; the outermost session of a thread
        counts). On the way in, a matcher over its budget drops its states (if no other session
        is open), and idle matchers are dropped when all together hold too much."""
        with self._lock:
            if self._active == 0 and self.entries > self.budget():
                self._drop_states()
            self._active += 1
            self.last_used = next(_CLOCK)
        _POOL.trim(self)
        outer = getattr(_THREAD, "work", None)
        if outer is None:
            _THREAD.work = Work(cpu_limit=probing)
        try:
            yield
        finally:
            if outer is None:
                _THREAD.work = None
            with self._lock:
                self._active -= 1

    def budget(self) -> int:
        """The entries this matcher keeps before dropping them: more for a bigger grammar."""
        return MAX_MATCHER_ENTRIES + MATCHER_ENTRIES_PER_ELEMENT * len(self.elems)

    def release(self) -> int:
        """Drop the states if no session is open (the pool asks); the entries freed."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            if self._active:
                return 0
            before = self.entries
            self._drop_states()
            return before - self.entries
        finally:
            self._lock.release()

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
        return self._expand(stack, _work())

    def _expand(self, stack: Stack, work: Work) -> frozenset[Stack]:
        """advance(), each stack visited charged to `work` (in batches, checked before the
        batch's end could pass a limit), so a runaway expansion stops mid-way."""
        hit = self._advanced.get(stack)
        if hit is not None:
            return hit
        todo, seen, out = [stack], set(), set()
        spent, left, depth = 0, work.left(), 0
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            n = len(cur)
            spent += n + 8
            if spent > left:
                work.add(spent)
                spent, left = 0, work.left()
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
                depth += n
                if len(out) > MAX_STATE_STACKS:
                    raise too_ambiguous("one rule expansion reaches", len(out), MAX_STATE_STACKS)
        work.add(spent)
        self._advanced[stack] = hit = frozenset(out)
        self._kept(_entries(len(hit), depth), work)
        return hit

    def _kept(self, n: int, work: Work) -> None:
        self.entries += n
        work.keep(n)

    def intern(self, stacks: frozenset[Stack]) -> int:
        """The state's id; the lock keeps ids and lists aligned when two engine threads (two
        servers in one process) share a compiled grammar. Everything else cached is idempotent."""
        if not stacks:
            return DEAD
        sid = self._ids.get(stacks)
        if sid is None:
            if len(stacks) > MAX_STATE_STACKS:
                raise too_ambiguous("the text so far matches", len(stacks), MAX_STATE_STACKS)
            with self._lock:
                sid = self._ids.get(stacks)
                if sid is None:
                    self.states.append(stacks)
                    self._info.append(None)
                    sid = self._ids[stacks] = len(self.states) - 1
                    self._kept(_entries(len(stacks), sum(map(len, stacks))), _work())
        return sid

    def info(self, sid: int) -> StateInfo:
        hit = self._info[sid]
        return hit if hit is not None else self._build_info(sid)

    def _build_info(self, sid: int) -> StateInfo:
        """One step: each stack's reaction to the next character, every expansion and union
        charged to the session's Work as it is built."""
        work = _work()
        work.begin_step()
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
            nxt = self._expand(rest, work)
            moves.append((ranges, nxt))
            char_tops.append(stack[-1])
        bounds = sorted(c for c in cuts if c < CP_END)
        at = {b: i for i, b in enumerate(bounds)}
        at[CP_END] = len(bounds)
        # each interval's next stacks: the union over the moves whose ranges cover it
        parts: list[list[frozenset[Stack]]] = [[] for _ in bounds]
        for ranges, stacks in moves:
            for lo, hi in ranges:
                work.add(len(stacks) * (at[hi + 1] - at[lo]))  # the union below, before it is built
                for i in range(at[lo], at[hi + 1]):
                    parts[i].append(stacks)
        nexts: list[int] = []
        done: dict[tuple[int, ...], int] = {}
        for part in parts:
            key = tuple(map(id, part))  # the same moves (e.g. one negated class) cover many intervals
            nid = done.get(key)
            if nid is None:
                nid = done[key] = self.intern(frozenset().union(*part))
            nexts.append(nid)
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
        self._kept(len(bounds), work)
        return info

    def step(self, sid: int, cp: int) -> int:
        """The state after one more code point (DEAD if no stack accepts it)."""
        info = self.info(sid)
        return info.nexts[bisect.bisect_right(info.bounds, cp) - 1]

    def after_token(self, sid: int, token: int) -> int:
        """The state after a token reference consumes `token` (DEAD if none matches)."""
        _work().begin_step()
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


def _entries(n_stacks: int, positions: int) -> int:
    """The entries a cached set of stacks counts for: one per stack and one for the set, plus
    one per 16 positions past 8 a stack (a deep stack is a big tuple: nested repetitions)."""
    return n_stacks + 1 + max(0, positions - 8 * n_stacks) // 16


_THREAD = threading.local()  # .work: the Work of the thread's outermost session


def _work() -> Work:
    """The current session's Work; outside any session each call counts on its own."""
    work = getattr(_THREAD, "work", None)
    return work if work is not None else Work()


_CLOCK = itertools.count(1)  # session order, for dropping the least recently used matcher


class _MatcherPool:
    """Every live matcher, so that together they keep at most MAX_TOTAL_ENTRIES: the compiled
    grammars a server caches would otherwise each keep what their last generation reached."""

    def __init__(self) -> None:
        self._members: weakref.WeakSet[Matcher] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, m: Matcher) -> None:
        with self._lock:
            self._members.add(m)

    def trim(self, current: Matcher) -> None:
        with self._lock:
            members = list(self._members)
        total = sum(m.entries for m in members)
        if total <= MAX_TOTAL_ENTRIES:
            return
        for m in sorted(members, key=lambda m: m.last_used):
            if m is not current:
                total -= m.release()
                if total <= MAX_TOTAL_ENTRIES:
                    return

    def total(self) -> int:
        """The stack entries all live matchers hold (what the budget counts)."""
        with self._lock:
            members = list(self._members)
        return sum(m.entries for m in members)


_POOL = _MatcherPool()


def matchers_entries() -> int:
    """The stack entries all live matchers hold together (bounded by MAX_TOTAL_ENTRIES)."""
    return _POOL.total()
