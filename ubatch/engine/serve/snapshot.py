"""What the engine looks like between two iterations, as a value: the slots, the queue, the KV
cells summed up, the counters and the last decode calls, built by the engine thread and read by
the HTTP side (`/slots`, `/metrics`, `/iterations`, `/engine/events`).

The HTTP handlers run on other threads than the engine. Reading the scheduler's slots, queue or
cells from there races the engine thread (a deque that grows mid-copy, a slot that starts a task
between two reads); so a reader asks the engine loop for a snapshot (engine/serve/engine_loop.py
`EngineLoop.snapshot`) and the engine thread builds one at its next iteration boundary, when
nothing moves: every snapshot is consistent (a slot's cells hold exactly its tokens) and nobody
changes it afterwards. None is built unless someone asks, so an unwatched server pays nothing.
A decode's ubatches are summarised by an observer on `Context.observers` only while someone
watches `/engine` (`DecodeWatch`): rows as runs of (sequence, kind), never the tokens.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ubatch.engine.batch import Batch, UBatch
from ubatch.engine.context.context import UBatchRecord
from ubatch.engine.kv.cache import N_KV_PAD, KVCache
from ubatch.engine.kv.cells import KVCells
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.serve.slot import Slot, SlotState
from ubatch.engine.serve.stats import IterationRecord, PrefixReuse, ReleaseRecord, SchedulerStats
from ubatch.engine.serve.task import Task, Timings
from ubatch.engine.spec.speculative import SpecStats

DECODE_HISTORY = 64
MAX_QUEUE_SHOWN = 32


@dataclass(frozen=True, slots=True)
class UBatchView:
    """One ubatch of a decode call: its rows as runs (seq, kind letter, n), the cells attention
    read per cache, and whether its graph was reused."""

    n_tokens: int
    n_outputs: int
    n_seqs: int
    n_kv: tuple[int, ...]
    reused: bool
    ms: float
    runs: tuple[tuple[int, str, int], ...]
    # per sequence of the ubatch, the LoRA adapters (id, scale) its rows applied (none: the base model)
    loras: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DecodeView:
    """One `Context.decode` call, ubatch by ubatch (published once all its rows ran)."""

    id: int
    t: float  # wall-clock seconds at its first ubatch
    n_tokens: int
    ubatches: tuple[UBatchView, ...]


def row_runs(batch: Batch, ub: UBatch) -> tuple[tuple[int, str, int], ...]:
    """The ubatch's rows as runs of equal (sequence, kind): a handful of entries, not its tokens."""
    runs: list[list[int | str]] = []
    for s, i in zip(ub.seq_id0.tolist(), ub.batch_idx.tolist()):
        k = batch.kind_of(i).value
        if runs and runs[-1][0] == s and runs[-1][1] == k:
            runs[-1][2] = int(runs[-1][2]) + 1
        else:
            runs.append([s, k, 1])
    return tuple((int(s), str(k), int(n)) for s, k, n in runs)


class DecodeWatch:
    """The observer a watched context carries, on the engine thread: a ring of the last decode
    calls, each added whole when its last ubatch ran."""

    def __init__(self) -> None:
        self.decodes: deque[DecodeView] = deque(maxlen=DECODE_HISTORY)
        self._batch: Batch | None = None  # held so that the next decode's batch is never mistaken for it
        self._open: list[UBatchView] = []
        self._t, self._next = 0.0, 0

    def __call__(self, batch: Batch, ub: UBatch, rec: UBatchRecord) -> None:
        try:
            self._record(batch, ub, rec)
        except Exception:  # a view must never fail a decode
            pass

    def _record(self, batch: Batch, ub: UBatch, rec: UBatchRecord) -> None:
        if batch is not self._batch:
            self._batch, self._open, self._t = batch, [], time.time()
            self._next += 1
        self._open.append(
            UBatchView(
                rec.n_tokens,
                rec.n_outputs,
                rec.n_seqs,
                tuple(rec.n_kv),
                rec.reused,
                rec.ms,
                row_runs(batch, ub),
                dict(rec.loras),
            )
        )
        if sum(u.n_tokens for u in self._open) >= batch.n_tokens:
            self.decodes.append(DecodeView(self._next, self._t, batch.n_tokens, tuple(self._open)))
            self._open = []


def cell_owners(c: KVCells) -> tuple[list[list[int]], list[list[int]]]:
    """A stream's cells as runs [code, n]: 0 empty, s + 1 held by sequence s alone, -(k + 1) held
    by the k-th set of several sequences (the sets listed beside). Runs keep a 32k-cell cache a
    few dozen numbers while sequences fill it in order."""
    pos, seq = c.pos, c.seq
    n = min(len(pos), len(seq))
    pos, seq = pos[:n], seq[:n]
    owners = seq.sum(1)
    code = np.where(owners == 1, seq.argmax(1) + 1, 0).astype(np.int64)
    code[pos < 0] = 0
    sets: list[list[int]] = []
    multi = (owners > 1) & (pos >= 0)
    if multi.any():
        uniq, inv = np.unique(seq[multi], axis=0, return_inverse=True)
        sets = [np.flatnonzero(u).tolist() for u in uniq]
        code[multi] = -(inv.reshape(-1) + 1)
    if n == 0:
        return [], sets
    edges = np.flatnonzero(np.diff(code)) + 1
    starts = np.concatenate(([0], edges))
    lengths = np.diff(np.concatenate((starts, [n])))
    return [[int(code[s]), int(k)] for s, k in zip(starts, lengths)], sets


@dataclass(frozen=True, slots=True)
class StreamView:
    """One stream of a cache: its cells by owner, and the cells each sequence holds."""

    used: int
    used_max_p1: int
    n_kv: int  # what a ubatch attends over now: used cells rounded up to N_KV_PAD
    n_shared: int
    runs: tuple[tuple[int, int], ...]
    sets: tuple[tuple[int, ...], ...]
    seq_cells: tuple[int, ...]  # [s]: cells holding sequence s


@dataclass(frozen=True, slots=True)
class CacheView:
    name: str
    size: int
    n_swa: int
    streams: tuple[StreamView, ...]

    def cells_of(self, seq_id: int) -> int:
        """The cells of every stream that hold `seq_id`."""
        return sum(st.seq_cells[seq_id] for st in self.streams if seq_id < len(st.seq_cells))


def cache_view(c: KVCache) -> CacheView:
    streams = []
    for cells in c.streams:
        runs, sets = cell_owners(cells)
        used_max_p1 = cells.used_max_p1
        n_kv = min(c.size, max(N_KV_PAD, -(-used_max_p1 // N_KV_PAD) * N_KV_PAD))
        n = min(len(cells.pos), len(cells.seq))
        held = cells.seq[:n][cells.pos[:n] >= 0].sum(0)
        streams.append(
            StreamView(
                cells.used,
                used_max_p1,
                n_kv,
                cells.n_shared,
                tuple((a, b) for a, b in runs),
                tuple(tuple(s) for s in sets),
                tuple(int(x) for x in held),
            )
        )
    return CacheView(c.name or "KV", c.size, c.n_swa, tuple(streams))


@dataclass(frozen=True, slots=True)
class SlotView:
    """A slot between two iterations: what /slots and /engine show of it."""

    id: int
    n_ctx: int
    state: SlotState
    speculative: bool
    task: Task | None  # the current task, else the last one (its fields are not changed)
    n_prompt_done: int
    n_prompt_cache: int
    reuse: PrefixReuse
    n_decoded: int
    has_new_line: bool
    text: str  # the answer so far
    n_cache: int  # the tokens its cells hold
    timings: Timings
    t_prompt_done: float

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.IDLE


def slot_view(s: Slot) -> SlotView:
    gen = s.gen
    return SlotView(
        s.id,
        s.n_ctx,
        s.state,
        s.speculative,
        s.task or s.last_task,
        s.n_prompt_done,
        s.n_prompt_cache,
        s.reuse,
        gen.n_decoded if gen is not None else 0,
        bool(gen and gen.has_new_line),
        gen.text if gen is not None else "",
        len(s.cache),
        s.timings(),
        s.t_prompt_done,
    )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The engine between two iterations. `stats` and `spec` are copies made for this snapshot:
    nobody changes them."""

    t: float  # wall-clock seconds
    iteration: int
    slots: tuple[SlotView, ...]
    queue: tuple[tuple[int, int], ...]  # (task id, prompt tokens) of the first waiting tasks
    n_queued: int
    n_deferred: int  # tasks not started: queued, and not yet handed to a worker
    stats: SchedulerStats
    spec: SpecStats
    kv_used: int
    n_cells_shared: int
    host_bytes: int
    host_entries: int
    graphs_reused: int
    n_ubatch_ctx: int
    records: tuple[IterationRecord, ...]
    releases: tuple[ReleaseRecord, ...]
    caches: tuple[CacheView, ...]
    decodes: tuple[DecodeView, ...]  # the last decode calls, while someone watches


def take(sch: Scheduler, n_deferred: int, watch: DecodeWatch | None = None) -> Snapshot:
    """The scheduler's state now; call it on the thread that runs the scheduler."""
    ctx, st = sch.ctx, sch.stats
    spec = sch.speculator.stats if sch.speculator is not None else SpecStats()
    return Snapshot(
        time.time(),
        sch.iteration,
        tuple(slot_view(s) for s in sch.slots),
        tuple((t.id, len(t.prompt)) for t in list(sch.queue)[:MAX_QUEUE_SHOWN]),
        len(sch.queue),
        n_deferred,
        copy.deepcopy(st),
        copy.deepcopy(spec),
        ctx.memory.used,
        sch.n_cells_shared,
        sch.host.nbytes,
        len(sch.host.entries),
        ctx.perf.graphs_reused,
        ctx.perf.n_ubatch,
        tuple(sch.records),
        tuple(sch.releases),
        tuple(cache_view(c) for c in ctx.memory.caches),
        tuple(watch.decodes) if watch is not None else (),
    )
