"""The engine, seen live: what `/engine/events` streams to the `/engine` page.

The page must cost the engine nothing when no one watches and little when someone does, so
nothing here runs unless a client is connected: the stream samples the scheduler's existing
state a few times a second (slots, queue, KV cells, counters) from the HTTP thread, and while a
watcher is connected one observer on `Context.observers` (the seam `ubatch explain` records
through) keeps a short summary of each ubatch: its rows as runs of (sequence, kind), never the
tokens. The engine thread is not paused: a snapshot copies small arrays and tolerates being a
row or two out of step with the engine, and a snapshot that races a change is skipped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ubatch.engine.batch import Batch, UBatch
from ubatch.engine.context.context import Context, UBatchRecord
from ubatch.engine.context.report import memory_plan
from ubatch.engine.kv.cache import N_KV_PAD, KVCache
from ubatch.engine.kv.cells import KVCells
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.serve.slot import Slot

DEFAULT_INTERVAL_S = 0.25  # four snapshots a second: live to the eye, nothing to the engine
MAX_DECODES_PER_EVENT = 32  # a burst of tiny decodes between two snapshots is shown by its tail
DECODE_HISTORY = 64


@dataclass(slots=True)
class UBatchView:
    """One ubatch of a decode call: its rows as runs [seq, kind, n] (kind p prompt, g generated,
    d drafted), the cells attention read per cache, and whether its graph was reused."""

    n_tokens: int
    n_outputs: int
    n_seqs: int
    n_kv: list[int]
    reused: bool
    ms: float
    runs: list[list[Any]]


@dataclass(slots=True)
class DecodeView:
    """One `Context.decode` call as the observer saw it, ubatch by ubatch."""

    id: int
    t: float  # wall-clock seconds at its first ubatch
    n_tokens: int
    ubatches: list[UBatchView] = field(default_factory=list)


def row_runs(batch: Batch, ub: UBatch) -> list[list[Any]]:
    """The ubatch's rows as runs of equal (sequence, kind): a handful of entries, not its tokens."""
    runs: list[list[Any]] = []
    for s, i in zip(ub.seq_id0.tolist(), ub.batch_idx.tolist()):
        k = batch.kind_of(i).value
        if runs and runs[-1][0] == s and runs[-1][1] == k:
            runs[-1][2] += 1
        else:
            runs.append([s, k, 1])
    return runs


class DecodeWatch:
    """The observer a watched context carries: a ring of the last decode calls' summaries.
    Called on the engine thread; the HTTP side reads the ring by id, never the engine."""

    def __init__(self) -> None:
        self.decodes: deque[DecodeView] = deque(maxlen=DECODE_HISTORY)
        self._batch: Batch | None = None  # held so that the next decode's batch is never mistaken for it
        self._next = 0

    def __call__(self, batch: Batch, ub: UBatch, rec: UBatchRecord) -> None:
        try:
            self._record(batch, ub, rec)
        except Exception:  # a view must never fail a decode
            pass

    def _record(self, batch: Batch, ub: UBatch, rec: UBatchRecord) -> None:
        if batch is not self._batch:
            self._batch = batch
            self._next += 1
            self.decodes.append(DecodeView(self._next, time.time(), batch.n_tokens))
        d = self.decodes[-1]
        d.ubatches.append(
            UBatchView(rec.n_tokens, rec.n_outputs, rec.n_seqs, list(rec.n_kv), rec.reused, rec.ms, row_runs(batch, ub))
        )

    def since(self, last_id: int) -> list[DecodeView]:
        """Decodes completed after `last_id`: the newest waits until its ubatches cover its rows."""
        try:
            ds = list(self.decodes)
        except RuntimeError:  # the engine appended while we copied: next time
            return []
        done = [d for d in ds[:-1] if d.id > last_id]
        if ds and ds[-1].id > last_id and sum(u.n_tokens for u in list(ds[-1].ubatches)) >= ds[-1].n_tokens:
            done.append(ds[-1])
        return done[-MAX_DECODES_PER_EVENT:]


def cell_owners(c: KVCells) -> tuple[list[list[int]], list[list[int]]]:
    """A stream's cells as runs [code, n]: 0 empty, s + 1 held by sequence s alone, -(k + 1) held
    by the k-th set of several sequences (the sets listed beside). Runs keep a 32k-cell cache a
    few dozen numbers while sequences fill it in order."""
    pos, seq = c.pos.copy(), c.seq.copy()
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


def cache_view(c: KVCache) -> dict[str, Any]:
    """One cache (non-SWA or SWA) and its streams: cells by owner, used, n_kv and its padding."""
    streams = []
    for i, cells in enumerate(list(c.streams)):
        runs, sets = cell_owners(cells)
        used_max_p1 = cells.used_max_p1
        n_kv = min(c.size, max(N_KV_PAD, -(-used_max_p1 // N_KV_PAD) * N_KV_PAD))
        streams.append(
            {
                "stream": i,
                "used": cells.used,
                "used_max_p1": used_max_p1,
                "n_kv": n_kv,
                "n_shared": cells.n_shared,
                "runs": runs,
                "sets": sets,
            }
        )
    return {"name": c.name or "KV", "size": c.size, "n_swa": c.n_swa, "pad": N_KV_PAD, "streams": streams}


def slot_view(s: Slot) -> dict[str, Any]:
    """A slot as the page draws it; every field read once, so a change mid-read costs nothing."""
    task, gen = s.task, s.gen
    n_decoded = gen.n_decoded if gen is not None else 0
    t = s.timings()
    return {
        "id": s.id,
        "state": s.state.value,
        "task": task.id if task is not None else None,
        "n_prompt": len(task.prompt) if task is not None else 0,
        "n_prompt_done": s.n_prompt_done,
        "n_prompt_cache": s.n_prompt_cache,
        "n_decoded": n_decoded,
        "n_cache": len(s.cache),
        "n_ctx": s.n_ctx,
        "gen_tps": round(1e3 * t.predicted_n / t.predicted_ms, 2) if t.predicted_ms > 0 else 0.0,
        "prompt_tps": round(1e3 * t.prompt_n / t.prompt_ms, 2) if t.prompt_ms > 0 and s.t_prompt_done else 0.0,
    }


def plan_view(ctx: Context) -> dict[str, Any]:
    """The memory plan (engine/context/report.py) in bytes: weights, KV per cache, the compute
    buffer and its largest tensors, the output rows."""
    p = memory_plan(ctx)
    return {
        "model_file": p.model_file,
        "arch": p.arch,
        "backend": p.backend,
        "device": p.device,
        "n_params": p.n_params,
        "weights": p.model_bytes + p.backend_bytes,
        "model_bytes": p.model_bytes,
        "backend_bytes": p.backend_bytes,
        "kv": [{"name": k.name or "KV", "bytes": k.k_bytes + k.v_bytes, "cells": k.size * k.n_stream} for k in p.kv],
        "compute": p.compute_bytes,
        "pp_bytes": p.pp_bytes,
        "tg_bytes": p.tg_bytes,
        "worst_case": list(p.worst_case),
        "peak": [{"name": n, "shape": list(shape), "bytes": b} for n, shape, b in p.peak[:8]],
        "outputs": p.output_bytes,
        "n_ctx": p.n_ctx,
        "n_ctx_seq": p.n_ctx_seq,
        "n_batch": p.n_batch,
        "n_ubatch": p.n_ubatch,
        "n_seq_max": p.n_seq_max,
        "n_outputs_max": p.n_outputs_max,
        "kv_unified": p.kv_unified,
    }


class EngineView:
    """What the `/engine` page's streams share: the observer, attached while anyone watches."""

    def __init__(self, sch: Scheduler) -> None:
        self.sch = sch
        self.watch = DecodeWatch()
        self.n_watchers = 0
        self._lock = threading.Lock()
        self._plan: dict[str, Any] | None = None

    def connect(self) -> None:
        """A watcher came: put the observer on the context (a new list, so the engine thread's
        loop over the old one is never disturbed)."""
        with self._lock:
            self.n_watchers += 1
            ctx = self.sch.ctx
            if self.watch not in ctx.observers:
                ctx.observers = [*ctx.observers, self.watch]

    def disconnect(self) -> None:
        """The last watcher left: take the observer off; the engine runs as if never watched."""
        with self._lock:
            self.n_watchers = max(0, self.n_watchers - 1)
            if self.n_watchers == 0:
                ctx = self.sch.ctx
                ctx.observers = [o for o in ctx.observers if o is not self.watch]

    def plan(self) -> dict[str, Any]:
        """Computed once: the memory plan does not change while the server runs."""
        if self._plan is None:
            self._plan = plan_view(self.sch.ctx)
        return self._plan

    def hello(self) -> dict[str, Any]:
        """The first event: what does not change (the plan, the slots' count, the batch sizes)."""
        cp = self.sch.ctx.cparams
        return {
            "plan": self.plan(),
            "n_slots": len(self.sch.slots),
            "n_batch": cp.n_batch,
            "n_ubatch": cp.n_ubatch,
            "interval_s": DEFAULT_INTERVAL_S,
        }

    def snapshot(self, last_decode: int) -> dict[str, Any]:
        """The state now, and the decodes after `last_decode`. May raise if the engine changed a
        structure mid-read: the caller skips that tick."""
        sch = self.sch
        st = sch.stats
        queue = list(sch.queue)
        return {
            "t": time.time(),
            "iteration": sch.iteration,
            "slots": [slot_view(s) for s in list(sch.slots)],
            "queue": [{"task": q.id, "n_prompt": len(q.prompt)} for q in queue[:32]],
            "n_queued": len(queue),
            "caches": [cache_view(c) for c in list(sch.ctx.memory.caches)],
            "decodes": [asdict(d) for d in self.watch.since(last_decode)],
            "totals": {
                "n_prompt_tokens": st.total.n_prompt_tokens,
                "n_predicted": st.total.n_predicted,
                "n_decode": st.n_decode_total,
                "n_rows": st.n_rows_total,
                "n_ubatch": st.n_ubatch_total,
                "n_requests": st.n_requests,
                "n_cancelled": st.n_cancelled,
                "graphs_reused": sch.ctx.perf.graphs_reused,
                "n_ubatch_ctx": sch.ctx.perf.n_ubatch,
            },
        }
