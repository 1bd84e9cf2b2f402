"""The limits that keep one grammar from stalling the process, and the compile-time check.

A GBNF grammar is cheap to parse but can be ruinous to match: a repetition of a rule that is
itself a repetition (`root ::= r{0,2000}` with `r ::= "a"{0,2000}`, which a JSON-schema pattern
`^(a{0,2000}){0,2000}$` becomes) expands to millions of elements, and its matcher states to
thousands of stacks each. The parser already refuses a repetition of a big inline group
(llama.cpp's rule); `check_expansion` multiplies the bounds through rule references too, so the
nesting is refused at compile time, wherever it is spelled. What static counting cannot see
(ambiguity: `((a{0,100}){0,100}){0,100}` is exactly 1,000,000 elements, but each `a` can be in
a million places) the matcher counts as it builds (`Work`): every step and every session stops
at its limit in the middle of the work, never after it, so no grammar costs more than about a
second of one core and some tens of MiB, and work a caller cancels (`cancel_scope`) stops too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ubatch.engine.grammar.elements import GrammarError

# Compile time: the most elements one expansion of the root may hold, counting nested
# repetition through rule references (`x{0,n}` multiplies x's own size by n). The grammars
# JSON schemas make stay far below (a 2000-character string is 8,000; an array of 50 objects
# with 2000-character strings 400,000); the nested-pattern probe is 4,000,000.
MAX_EXPANSION = 1_000_000
# Compile time: the elements all repetitions may add (`"a"{2000}` is 2,000 copies; a grammar of
# many such items would fill gigabytes from a small text). A 20,000-item anyOf schema is 500,000.
MAX_GRAMMAR_ELEMENTS = 2_000_000

# Matching, counted as it is done (Work): the unit is a word of memory touched, a stack of
# depth d costing d + 8 (the tuple's header), so that the count tracks both time and memory.
# One state (the set of stacks a text can be in) larger than MAX_STATE_STACKS, or one step
# (a state's reaction to the next character) past MAX_STEP_WORK (~8 MiB, ~0.1 s), means a
# grammar so ambiguous that every token would cost seconds; an enum of 20,000 values is one
# stack per value, well under. A session (a compile-time probe, one token's sampling) may do
# MAX_SESSION_WORK and keep MAX_SESSION_ENTRIES new entries (~40 MiB); a probe also spends at most
# MAX_SESSION_CPU_S of its thread's CPU time: the backstop where the counts misjudge the cost.
MAX_STATE_STACKS = 50_000
MAX_STEP_WORK = 1_000_000
MAX_SESSION_WORK = 4_000_000
MAX_SESSION_ENTRIES = 300_000
MAX_SESSION_CPU_S = 1.0
CHECK_EVERY = 50_000  # units between looks at the clock and at cancellation (~5 ms)
# A probe past PROBE_YIELD_AFTER units (sane grammars stay far below) sleeps PROBE_YIELD_S at
# each check: it runs on a request worker and holds the GIL the engine thread needs, so a
# hostile grammar's second of work takes a little longer and slows the generations beside it less.
PROBE_YIELD_AFTER = 200_000
PROBE_YIELD_S = 0.002
# Compile time, when asked (compile_grammar(probe=True), GrammarCache): the matcher walks this
# many characters along its largest states, so that a grammar ambiguous from its start (the
# usual shape: a pattern's nested repetition) is refused before a request runs it rather than
# mid-generation. Milliseconds for sane grammars.
PROBE_STEPS = 16

# Matching memory: the stack entries one matcher may keep interned (states and expansion
# caches, about 130 bytes each) before it drops them at the next token and re-derives what it
# needs (~26 MiB; the JSON grammar reaches that after some 150 documents), plus
# MATCHER_ENTRIES_PER_ELEMENT per element of the grammar (a 20,000-value enum has states of
# 20,000 stacks: it must keep a few), and what all live matchers together may keep before idle
# ones are dropped (~130 MiB).
MAX_MATCHER_ENTRIES = 200_000
MATCHER_ENTRIES_PER_ELEMENT = 2
MAX_TOTAL_ENTRIES = 1_000_000
ENTRY_BYTES = 130  # measured with tracemalloc over JSON documents: for size estimates

_SATURATE = 10**15  # sizes past this are all "too large": keeps the arithmetic small

Term = tuple[int, int]  # (multiplier, referenced rule id or -1 for a terminal) of one item


class WorkCancelled(GrammarError):
    """The caller gave up on the work (its client left, the server is stopping)."""


_LOCAL = threading.local()


@contextmanager
def cancel_scope(cancel: threading.Event) -> Iterator[None]:
    """Grammar work on this thread stops with WorkCancelled once `cancel` is set (checked every
    CHECK_EVERY units): how a server stops a request's preparation when its client leaves."""
    before = getattr(_LOCAL, "cancel", None)
    _LOCAL.cancel = cancel
    try:
        yield
    finally:
        _LOCAL.cancel = before


_PROBING = threading.RLock()  # re-entrant: a probe inside a probe (none today) must not deadlock
_HEAVY = threading.Event()  # a probe went past PROBE_YIELD_AFTER since the last turn began


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where there is none."""
    name = ctypes.util.find_library("c")
    try:
        f = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if f is not None:
        f.argtypes, f.restype = [ctypes.c_size_t], ctypes.c_int
    return f


@contextmanager
def probing_turn() -> Iterator[None]:
    """Compile-time probes take turns across threads: however many hostile grammars arrive at
    once, one at a time holds memory (a grammar's budget, not four). Waiting stays cancellable.
    After a probe that went far, the next turn hands the freed memory back to the system: each
    request worker has its own malloc arena, and sixteen of them kept a refusal's sets each.
    The cyclic garbage collector pauses during a turn (at most MAX_SESSION_CPU_S): its full
    passes over a large grammar's objects were 60% of a 20,000-value enum's probe, and CPU
    time counts against the budget. The turn ends with one pass over what it allocated, or
    back-to-back turns (a sustained attack) would leave no gap for a collection."""
    while not _PROBING.acquire(timeout=0.02):
        check_cancelled()
    if _HEAVY.is_set():  # the last heavy probe's sets are freed by now, in its thread's malloc arena
        _HEAVY.clear()
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
            gc.collect(0)  # what the turn allocated is all young: a refused probe's cycles go now
        _PROBING.release()


def check_cancelled() -> None:
    """WorkCancelled if this thread's cancel scope was cancelled: for loops outside the matcher."""
    cancel = getattr(_LOCAL, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise WorkCancelled("cancelled: the request was abandoned before its grammar was ready")


class Work:
    """The grammar work of one session, counted while it is done: the units of the current
    step and of the session, the entries the session kept, its thread's CPU time, and the
    caller's cancellation. Each limit raises the moment it is passed, so a runaway costs the
    limit, not what it would have built."""

    __slots__ = ("step", "total", "entries", "_cpu0", "_next_check")

    def __init__(self, cpu_limit: bool = False) -> None:
        """`cpu_limit`: also MAX_SESSION_CPU_S of this thread's CPU time, for compile-time probes
        (a generation's session also walks the vocabulary, which a wide legitimate grammar
        may take a second to do with every candidate read: its counts bound it instead)."""
        self.step = self.total = self.entries = 0
        self._cpu0 = time.thread_time() if cpu_limit else None
        self._next_check = CHECK_EVERY

    def begin_step(self) -> None:
        self.step = 0

    def left(self) -> int:
        """Units that may be spent before add() must look (a loop batches its charges)."""
        return min(MAX_STEP_WORK - self.step, self._next_check - self.total)

    def add(self, n: int) -> None:
        self.step += n
        self.total += n
        if self.step > MAX_STEP_WORK:
            raise too_ambiguous("one step of matching builds", self.step, MAX_STEP_WORK)
        if self.total >= self._next_check:
            self._next_check = self.total + CHECK_EVERY
            if self.total > MAX_SESSION_WORK:
                raise too_ambiguous("matching the text so far builds", self.total, MAX_SESSION_WORK)
            check_cancelled()
            if self._cpu0 is None:
                return
            if self.total > PROBE_YIELD_AFTER:
                _HEAVY.set()
                time.sleep(PROBE_YIELD_S)
            cpu = time.thread_time() - self._cpu0
            if cpu > MAX_SESSION_CPU_S:
                raise GrammarError(
                    f"grammar too ambiguous: matching took more than {MAX_SESSION_CPU_S:g} s of CPU "
                    f"({cpu:.1f} s); simplify nested or overlapping repetitions"
                )

    def keep(self, n: int) -> None:
        """`n` more entries interned by this session (its memory)."""
        self.entries += n
        if self.entries > MAX_SESSION_ENTRIES:
            raise too_ambiguous("matching the text so far keeps", self.entries, MAX_SESSION_ENTRIES)


def too_ambiguous(what: str, n: int, limit: int) -> GrammarError:
    return GrammarError(
        f"grammar too ambiguous: {what} more than {limit:,} grammar positions ({n:,}); "
        "simplify nested or overlapping repetitions"
    )


def check_expansion(terms: dict[int, list[Term]], names: dict[int, str], root: int) -> None:
    """GrammarError when the rules reachable from `root` expand to more than MAX_EXPANSION
    elements. A rule's size is the largest of its items' multiplier x referenced size; inside a
    recursive cycle a reference counts as the cycle's largest non-recursive size (one level of
    recursion), since each further level needs more input to be reached."""
    size: dict[int, int] = {}
    for comp in _cycles(terms, root):
        members = set(comp)
        base = {
            r: max([1] + [_mul(m, size[t] if t >= 0 else 1) for m, t in terms.get(r, []) if t not in members])
            for r in comp
        }
        inner = max(base.values())
        for r in comp:
            size[r] = max([base[r]] + [_mul(m, inner) for m, t in terms.get(r, []) if t in members])
    total = size[root]
    if total > MAX_EXPANSION:
        raise GrammarError(
            f"grammar too large: nested repetition in rule '{names.get(root, root)}' expands to ~{total:,} "
            f"elements (limit {MAX_EXPANSION:,}); simplify the pattern or lower its bounds"
        )


def _mul(a: int, b: int) -> int:
    return min(a * b, _SATURATE)


def _cycles(terms: dict[int, list[Term]], root: int) -> list[list[int]]:
    """The strongly connected components of the reference graph reachable from `root`, each
    after every component it references (Tarjan's algorithm, with an explicit stack so a chain
    of thousands of rules costs no recursion)."""
    index: dict[int, int] = {root: 0}
    low: dict[int, int] = {root: 0}
    stack, on_stack, out = [root], {root}, []
    work = [(root, 0)]
    succs: dict[int, list[int]] = {}
    while work:
        v, k = work[-1]
        succ = succs.get(v)
        if succ is None:
            succ = succs[v] = [t for _, t in terms.get(v, []) if t >= 0]
        if k < len(succ):
            work[-1] = (v, k + 1)
            w = succ[k]
            if w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, 0))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
            continue
        work.pop()
        if work:
            u = work[-1][0]
            low[u] = min(low[u], low[v])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)
    return out
