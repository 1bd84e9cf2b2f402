"""How a slot's task ends: finished (its Final event), failed, cancelled, or its cached prompt
purged to make room. A mixin of the scheduler (engine/scheduler.py), kept apart so the loop that
batches and decodes stays readable; it uses the scheduler's slots, stats and records."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ubatch.engine.serve.slot import Slot, SlotState
from ubatch.engine.serve.stats import ReleaseRecord, SchedulerStats
from ubatch.engine.serve.task import Failed, Final, RequestError, Task

if TYPE_CHECKING:
    from ubatch.engine.context.context import Context


class SlotEnds:
    ctx: Context
    slots: list[Slot]
    stats: SchedulerStats
    releases: deque[ReleaseRecord]
    queue: deque[Task]
    iteration: int
    listener: Callable[[str, Slot], None] | None

    def _finish(self, s: Slot, stop_type: str = "", reason: str = "") -> None:
        """The task's Final event; `stop_type` / `reason` override the generation's own (shutdown)."""
        task, gen = s.task, s.gen
        assert task is not None and gen is not None
        tail = gen.finish()
        content = tail if task.params.stream else gen.text
        task.emit(
            Final(
                task,
                s.id,
                content,
                list(gen.tokens),
                gen.n_decoded,
                len(task.prompt),
                len(s.cache),
                stop_type or s.stop_type,
                gen.stopping_word,
                gen.truncated,
                gen.has_new_line,
                s.timings(),
                gen.probs,
            )
        )
        self.stats.generation_done(gen.n_decoded, (s.t_last - s.t_prompt_done) * 1e3)
        self._release(s, reason or s.stop_type)

    def _release(self, s: Slot, reason: str) -> None:
        task = s.task
        self.releases.append(
            ReleaseRecord(s.id, task.id if task else -1, reason, self.iteration, task.cancel_iteration if task else -1)
        )
        s.last_task, s.task = task, None
        s.state = SlotState.IDLE
        s.t_last_used = time.perf_counter()
        self._notify("release", s)

    def _notify(self, kind: str, s: Slot) -> None:
        if self.listener is not None:
            try:
                self.listener(kind, s)
            except Exception:  # a logging hook must not break the engine
                pass

    def _fail(self, s: Slot, err: RequestError) -> None:
        """Error the slot's task, free its cells (llama-server clears a failed slot's KV)."""
        if not s.busy:
            return
        s.task.emit(Failed(s.task, err))  # type: ignore[union-attr]
        self.ctx.memory.seq_rm(s.id)
        s.cache.clear()
        self._release(s, "error")

    def _reap_cancelled(self) -> None:
        for s in self.slots:
            if s.busy and s.task.cancelled:  # type: ignore[union-attr]
                self.stats.n_cancelled += 1
                self.ctx.memory.seq_rm(s.id)
                s.cache.clear()
                self._release(s, "cancelled")
        if any(t.cancelled for t in self.queue):
            self.stats.n_cancelled += sum(t.cancelled for t in self.queue)
            self.queue = deque(t for t in self.queue if not t.cancelled)

    def _purge_idle(self) -> bool:
        """Unified KV: drop the largest idle slot's cached prompt to make room (llama-server)."""
        if not self.ctx.cparams.kv_unified:
            return False
        idle = [s for s in self.slots if not s.busy and s.cache]
        if not idle:
            return False
        s = max(idle, key=lambda s: len(s.cache))
        self.ctx.memory.seq_rm(s.id)
        s.cache.clear()
        return True
