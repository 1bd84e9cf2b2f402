"""The server's slot save / restore / erase (llama-server's POST /slots/{id}?action=...) on the
engine thread.

Like embedding tasks, a slot action takes no part in continuous batching: it touches one idle
slot's cells between two iterations. `StateRunner` is a side runner (engine/serve/side_runner.py):
it runs the actions whose slot is idle and keeps the others for a later iteration (llama-server
defers an action on a slot that is processing). The state itself is engine/context/state.py's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ubatch.engine.context import state
from ubatch.engine.context.context import Context
from ubatch.engine.context.state_file import StateError, read_file, write_file
from ubatch.engine.errors import EngineDown, EngineError, ErrorKind
from ubatch.engine.serve.side_runner import SideRunner
from ubatch.engine.serve.slot import Slot
from ubatch.engine.serve.stats import SchedulerStats
from ubatch.engine.serve.task import Job, Sink


@dataclass(slots=True, eq=False)
class SlotTask(Job):
    """One slot action; `path` is the file under --slot-save-path (save / restore)."""

    id: int
    action: str  # "save" | "restore" | "erase"
    id_slot: int
    filename: str
    path: str
    sink: Sink
    cancelled: bool = False
    cancel_iteration: int = -1


@dataclass(slots=True)
class SlotResult:
    """llama-server's slot_save_load / slot_erase result, as its JSON."""

    task: SlotTask
    body: dict[str, object]


class StateRunner(SideRunner[SlotTask]):
    def __init__(self, ctx: Context, slots: list[Slot], stats: SchedulerStats) -> None:
        super().__init__(SlotTask, ctx, slots, stats)

    def run(self) -> None:
        later: deque[SlotTask] = deque()
        while self.pending:
            t = self.pending.popleft()
            slot = next((s for s in self.slots if s.id == t.id_slot), None)
            if slot is not None and slot.busy:
                later.append(t)
                continue
            try:
                t.emit(SlotResult(t, self._act(t, slot)))
            except EngineError as e:
                t.fail(e)
            except EngineDown:  # a lost rank (erasing cells is announced to every rank): the loop stops
                raise
            except Exception as e:  # a bug fails this request, never the engine thread
                t.fail(EngineError(ErrorKind.INTERNAL, f"Unable to {t.action} slot: {e}"))
        self.pending = later

    def _act(self, t: SlotTask, slot: Slot | None) -> dict[str, object]:
        if slot is None:
            raise EngineError(ErrorKind.INVALID_REQUEST, "Invalid slot ID")
        t0 = time.perf_counter()
        if t.action == "erase":
            n = len(slot.cache)
            slot.forget(self.ctx.memory)
            return {"id_slot": slot.id, "n_erased": n}
        if t.action == "save":
            try:
                n_bytes = write_file(t.path, state.capture(self.ctx, slot.id, list(slot.cache)))
            except StateError:
                raise EngineError(ErrorKind.INTERNAL, "Unable to save slot") from None
            ms = (time.perf_counter() - t0) * 1e3
            return {
                "id_slot": slot.id,
                "filename": t.filename,
                "n_saved": len(slot.cache),
                "n_written": n_bytes,
                "timings": {"save_ms": ms},
            }
        try:  # the file's kind and size are checked before its body is read (state_file.read_file)
            st, n_read = read_file(t.path, t.filename, follow_symlinks=False)
            slot.prompt_save()  # the prompt the file replaces goes to host memory, as any prefix that leaves
            n = state.restore(self.ctx, st, slot.id)
        except StateError as e:
            raise EngineError(ErrorKind.INVALID_REQUEST, f"Unable to restore slot: {e}") from None
        slot.cache[:] = st.tokens
        slot.taint = -1  # the cells are the file's, as saved: no earlier shift marks them any more
        ms = (time.perf_counter() - t0) * 1e3
        return {
            "id_slot": slot.id,
            "filename": t.filename,
            "n_restored": n,
            "n_read": n_read,
            "timings": {"restore_ms": ms},
        }
