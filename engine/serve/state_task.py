"""The server's slot save / restore / erase (llama-server's POST /slots/{id}?action=...) on the
engine thread.

Like embedding tasks, a slot action takes no part in continuous batching: it touches one idle
slot's cells between two iterations. `StateRunner` is one of the engine thread's side runners
(with the embedding runner; the interface: `step`, `busy`, `pending`, `fail_pending`): it takes
its own tasks out of the scheduler's queue, runs those whose slot is idle and keeps the others
for a later iteration (llama-server defers an action on a slot that is processing). The state
itself is `engine/state.py`'s.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ubatch.engine.context import state
from ubatch.engine.context.state_file import StateError, from_bytes, write_file
from ubatch.engine.serve.task import Failed, RequestError

if TYPE_CHECKING:
    from ubatch.engine.serve.scheduler import Scheduler


@dataclass(slots=True, eq=False)
class SlotTask:
    """One slot action; `path` is the file under --slot-save-path (save / restore)."""

    id: int
    action: str  # "save" | "restore" | "erase"
    id_slot: int
    filename: str
    path: str
    sink: Callable[[Any], None]
    cancelled: bool = False
    cancel_iteration: int = -1

    def emit(self, event: Any) -> None:
        if not self.cancelled:
            self.sink(event)


@dataclass(slots=True)
class SlotResult:
    """llama-server's slot_save_load / slot_erase result, as its JSON."""

    task: SlotTask
    body: dict[str, Any]


class StateRunner:
    def __init__(self) -> None:
        self.pending: deque[SlotTask] = deque()  # taken from the queue, waiting for their slot

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def fail_pending(self, err: RequestError) -> None:
        while self.pending:
            t = self.pending.popleft()
            t.emit(Failed(t, err))  # type: ignore[arg-type]

    def step(self, sch: Scheduler) -> None:
        mine = [t for t in sch.queue if isinstance(t, SlotTask)]
        if mine:
            rest = [t for t in sch.queue if not isinstance(t, SlotTask)]
            sch.queue.clear()
            sch.queue.extend(rest)
            self.pending.extend(mine)
        later: deque[SlotTask] = deque()
        while self.pending:
            t = self.pending.popleft()
            if t.cancelled:
                continue
            slot = next((s for s in sch.slots if s.id == t.id_slot), None)
            if slot is not None and slot.busy:
                later.append(t)
                continue
            try:
                t.emit(SlotResult(t, run(sch, t, slot)))
            except RequestError as e:
                t.emit(Failed(t, e))  # type: ignore[arg-type]
            except Exception as e:  # a bug fails this request, never the engine thread
                t.emit(Failed(t, RequestError(f"Unable to {t.action} slot: {e}", 500, "server_error")))  # type: ignore[arg-type]
        self.pending = later


def run(sch: Scheduler, t: SlotTask, slot: Any) -> dict[str, Any]:
    if slot is None:
        raise RequestError("Invalid slot ID")
    t0 = time.perf_counter()
    if t.action == "erase":
        n = len(slot.cache)
        sch.ctx.memory.seq_rm(slot.id)
        slot.cache.clear()
        return {"id_slot": slot.id, "n_erased": n}
    if t.action == "save":
        try:
            n_bytes = write_file(t.path, state.capture(sch.ctx, slot.id, list(slot.cache)))
        except StateError:
            raise RequestError("Unable to save slot", 500, "server_error") from None
        ms = (time.perf_counter() - t0) * 1e3
        return {
            "id_slot": slot.id,
            "filename": t.filename,
            "n_saved": len(slot.cache),
            "n_written": n_bytes,
            "timings": {"save_ms": ms},
        }
    try:
        with open(t.path, "rb") as f:
            data = f.read()
        st = from_bytes(data, t.filename)
        n = state.restore(sch.ctx, st, slot.id)
    except OSError as e:
        raise RequestError(f"Unable to restore slot: cannot read {t.filename} ({os.strerror(e.errno or 0)})") from None
    except StateError as e:
        raise RequestError(f"Unable to restore slot: {e}") from None
    slot.cache[:] = st.tokens
    ms = (time.perf_counter() - t0) * 1e3
    return {
        "id_slot": slot.id,
        "filename": t.filename,
        "n_restored": n,
        "n_read": len(data),
        "timings": {"restore_ms": ms},
    }
