"""A server slot: one sequence id, its cached tokens and the generation it runs.

The slot keeps what outlives a request (the tokens its KV cells hold, for prompt caching) and
the bookkeeping llama-server reports per slot (`/slots`, timings); everything about turning
logits into text is the slot's `Generation`, shared with every other way ubatch generates.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import SupportsIndex

from ubatch.engine.generation.generation import Generation
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.serve.stats import PrefixReuse
from ubatch.engine.serve.task import Task, Timings
from ubatch.engine.spec.speculative import Draft, SpecStats

# llama-server's stop types for the reasons a generation ends
STOP_TYPES = {"": "none", "eog": "eos", "word": "word", "length": "limit", "context": "limit"}


class SlotTokens(list[int]):
    """The tokens a slot's KV cells hold, by position: a list that remembers the first position
    changed in place since the prefix index last read it (`take_changed`), so the index updates
    only what changed. Appending needs no mark (the index reads past what it holds), so the
    decode and prefill paths run at plain list speed; every other mutation marks."""

    __slots__ = ("changed",)

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        super().__init__(tokens)
        self.changed = 0

    def take_changed(self) -> int:
        """The first position changed since the last call (sys.maxsize: none); resets the mark."""
        n, self.changed = self.changed, sys.maxsize
        return n

    def _mark(self, i: int) -> None:
        self.changed = min(self.changed, max(i, 0))

    def _mark_key(self, key: SupportsIndex | slice) -> None:
        if isinstance(key, slice):
            r = range(*key.indices(len(self)))
            self._mark(min(r[0], r[-1]) if r else r.start)
        else:
            i = key.__index__()
            self._mark(i + len(self) if i < 0 else i)

    def __setitem__(self, key, value):  # type: ignore[no-untyped-def]  # list's overloads, unchanged
        self._mark_key(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: SupportsIndex | slice) -> None:
        self._mark_key(key)
        super().__delitem__(key)

    def insert(self, i: SupportsIndex, x: int) -> None:
        j = i.__index__()
        self._mark(j + len(self) if j < 0 else j)
        super().insert(i, x)

    def pop(self, i: SupportsIndex = -1) -> int:
        j = i.__index__()
        self._mark(j + len(self) if j < 0 else j)
        return super().pop(i)

    def remove(self, x: int) -> None:
        self._mark(self.index(x))
        super().remove(x)

    def clear(self) -> None:
        self._mark(0)
        super().clear()

    def sort(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]  # list's signature
        self._mark(0)
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._mark(0)
        super().reverse()

    def __imul__(self, n: SupportsIndex) -> SlotTokens:
        if n.__index__() <= 0:
            self._mark(0)
        return super().__imul__(n)


class SlotState(Enum):
    IDLE = "idle"
    PROCESSING_PROMPT = "processing_prompt"
    GENERATING = "generating"


@dataclass(slots=True)
class Slot:
    id: int
    n_ctx: int
    state: SlotState = SlotState.IDLE
    task: Task | None = None
    last_task: Task | None = None
    cache: SlotTokens = field(default_factory=SlotTokens)  # tokens whose K/V sit in the cache, by position
    i_prompt: int = 0  # next prompt token to evaluate
    gen: Generation | None = None  # the current (or, when idle, the last) task's generation
    draft: Draft = field(default_factory=lambda: Draft([]))  # tokens to verify in this iteration
    spec: SpecStats = field(default_factory=SpecStats)  # the current task's drafts
    speculative: bool = False  # the server drafts for its slots (/slots' "speculative")
    n_prompt_cache: int = 0
    reuse: PrefixReuse = field(default_factory=PrefixReuse)  # where n_prompt_cache came from
    # cells from this position on hold K/V a fresh prefill of `cache` would not give (a context
    # shift re-rotated them after dropping what they attended to; --cache-reuse moved them):
    # never shared with another request, never reused past. -1: every cell is exact
    taint: int = -1
    # the LoRA adapters (id, scale) its cells were computed under: a prefix is reused only by a
    # request that applies the same ones (engine/serve/prefix_index.py)
    lora: tuple[tuple[int, float], ...] = ()
    n_prompt_done: int = 0
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    t_last: float = 0.0
    t_last_used: float = 0.0
    # set by the prefix index (its `save`): keeps the slot's exact prefix in host memory before
    # its cells from a position on go by a path outside the scheduler (a side runner's)
    saver: Callable[[Slot, int], bool] | None = field(default=None, compare=False, repr=False)

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.IDLE

    @property
    def n_exact(self) -> int:
        """The leading cached tokens whose cells equal a fresh prefill of them."""
        return len(self.cache) if self.taint < 0 else min(self.taint, len(self.cache))

    def cut(self, n: int) -> None:
        """Forget the cached tokens from position n on (the caller removed their cells)."""
        del self.cache[n:]
        if self.taint >= n:
            self.taint = -1

    @property
    def n_decoded(self) -> int:
        return self.gen.n_decoded if self.gen else 0

    @property
    def text(self) -> str:
        return self.gen.text if self.gen else ""

    @property
    def has_new_line(self) -> bool:
        return bool(self.gen and self.gen.has_new_line)

    @property
    def stop_type(self) -> str:
        return STOP_TYPES[self.gen.stop_reason] if self.gen else "none"

    @property
    def truncated(self) -> bool:
        return bool(self.gen and self.gen.truncated)

    def timings(self) -> Timings:
        t_gen = max(self.t_last - self.t_prompt_done, 1e-6) if self.n_decoded else 0.0
        return Timings(
            self.n_prompt_cache,
            self.n_prompt_done,
            (self.t_prompt_done - self.t_start) * 1e3,
            self.n_decoded,
            t_gen * 1e3,
            self.spec.n_drafted,
            self.spec.n_accepted,
        )

    def prompt_save(self, keep: int = 0) -> bool:
        """llama-server's prompt_save, for a side runner about to take the slot's cells from
        position `keep` on: the prefix goes to host memory when nobody else holds it."""
        return self.saver is not None and self.saver(self, keep)

    def forget(self, memory: KVMemory) -> None:
        """Free the slot's cells and forget the tokens they held (its cached prompt)."""
        memory.seq_rm(self.id)
        self.cut(0)

    def start(self, task: Task) -> None:
        """Take `task`: the prompt is to be processed; counters of the last task are reset."""
        self.task, self.state = task, SlotState.PROCESSING_PROMPT
        self.t_start = time.perf_counter()
        self.n_prompt_cache = self.n_prompt_done = 0
        self.reuse = PrefixReuse()
        self.gen = None
        self.draft, self.spec = Draft([]), SpecStats()
