"""The engine, seen live: what `/engine/events` streams to the `/engine` page.

The page must cost the engine nothing when no one watches and little when someone does, so
nothing here runs unless a client is connected: each tick asks the engine loop for a snapshot
(engine/serve/snapshot.py), which the engine thread builds between two iterations, and while a
watcher is connected one observer on `Context.observers` (the seam `ubatch explain` records
through) summarises each decode's ubatches. This module only turns those values into the
page's JSON: it never reads the scheduler.
"""

from __future__ import annotations

import threading
from typing import Any

from ubatch.engine.context.report import MemoryPlan
from ubatch.engine.kv.cache import N_KV_PAD
from ubatch.engine.serve.engine_loop import EngineLoop
from ubatch.engine.serve.handle import EngineHandle
from ubatch.engine.serve.snapshot import CacheView, DecodeView, SlotView, Snapshot

DEFAULT_INTERVAL_S = 0.25  # four snapshots a second: live to the eye, nothing to the engine
MAX_DECODES_PER_EVENT = 32  # a burst of tiny decodes between two snapshots is shown by its tail


def cache_json(c: CacheView) -> dict[str, Any]:
    """One cache (non-SWA or SWA) and its streams: cells by owner, used, n_kv and its padding."""
    streams = [
        {
            "stream": i,
            "used": st.used,
            "used_max_p1": st.used_max_p1,
            "n_kv": st.n_kv,
            "n_shared": st.n_shared,
            "runs": [list(r) for r in st.runs],
            "sets": [list(x) for x in st.sets],
        }
        for i, st in enumerate(c.streams)
    ]
    return {"name": c.name, "size": c.size, "n_swa": c.n_swa, "pad": N_KV_PAD, "streams": streams}


def slot_json(s: SlotView) -> dict[str, Any]:
    """A slot as the page draws it."""
    task, t = (s.task if s.busy else None), s.timings
    return {
        "id": s.id,
        "state": s.state.value,
        "task": task.id if task is not None else None,
        "n_prompt": len(task.prompt) if task is not None else 0,
        "n_prompt_done": s.n_prompt_done,
        "n_prompt_cache": s.n_prompt_cache,
        "n_decoded": s.n_decoded,
        "n_cache": s.n_cache,
        "n_ctx": s.n_ctx,
        "gen_tps": round(1e3 * t.predicted_n / t.predicted_ms, 2) if t.predicted_ms > 0 else 0.0,
        "prompt_tps": round(1e3 * t.prompt_n / t.prompt_ms, 2) if t.prompt_ms > 0 and s.t_prompt_done else 0.0,
    }


def decode_json(d: DecodeView) -> dict[str, Any]:
    return {
        "id": d.id,
        "t": d.t,
        "n_tokens": d.n_tokens,
        "ubatches": [
            {
                "n_tokens": u.n_tokens,
                "n_outputs": u.n_outputs,
                "n_seqs": u.n_seqs,
                "n_kv": list(u.n_kv),
                "reused": u.reused,
                "ms": u.ms,
                "runs": [list(r) for r in u.runs],
                "lora": {str(k): [{"id": i, "scale": v} for i, v in p] for k, p in u.loras.items()},
            }
            for u in d.ubatches
        ],
    }


def plan_view(p: MemoryPlan) -> dict[str, Any]:
    """The memory plan (engine/context/report.py) in bytes: weights, KV per cache, the compute
    buffer and its largest tensors, the output rows."""
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
    """What the `/engine` page's streams share: the engine loop's door and the fixed facts."""

    def __init__(self, loop: EngineLoop, handle: EngineHandle) -> None:
        self.loop, self.handle = loop, handle
        self._lock = threading.Lock()
        self._plan: dict[str, Any] | None = None

    def connect(self) -> None:
        """A watcher came: the engine summarises its decodes from now on."""
        self.loop.watch_decodes(True)

    def disconnect(self) -> None:
        """The last watcher left: the engine runs as if never watched."""
        self.loop.watch_decodes(False)

    def hello(self) -> dict[str, Any]:
        """The first event: what does not change (the plan, the slots' count, the batch sizes)."""
        with self._lock:
            if self._plan is None:
                self._plan = plan_view(self.handle.plan)
        h = self.handle
        return {
            "plan": self._plan,
            "n_slots": h.n_slots,
            "n_batch": h.n_batch,
            "n_ubatch": h.n_ubatch,
            "interval_s": DEFAULT_INTERVAL_S,
        }


def state_json(snap: Snapshot, last_decode: int) -> dict[str, Any]:
    """A `state` event: the snapshot, with the decodes after `last_decode`."""
    st = snap.stats
    return {
        "t": snap.t,
        "iteration": snap.iteration,
        "slots": [slot_json(s) for s in snap.slots],
        "queue": [{"task": i, "n_prompt": n} for i, n in snap.queue],
        "n_queued": snap.n_queued,
        "caches": [cache_json(c) for c in snap.caches],
        "decodes": [decode_json(d) for d in snap.decodes if d.id > last_decode][-MAX_DECODES_PER_EVENT:],
        "totals": {
            "n_prompt_tokens": st.total.n_prompt_tokens,
            "n_predicted": st.total.n_predicted,
            "n_decode": st.n_decode_total,
            "n_rows": st.n_rows_total,
            "n_ubatch": st.n_ubatch_total,
            "n_requests": st.n_requests,
            "n_cancelled": st.n_cancelled,
            "graphs_reused": snap.graphs_reused,
            "n_ubatch_ctx": snap.n_ubatch_ctx,
        },
    }
