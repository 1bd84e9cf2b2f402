"""The side runners of the engine loop: work that takes no part in continuous batching and runs
on the engine thread before each iteration's batch, on idle slots: embedding and rerank tasks
(engine/serve/embedding_task.py), slot save / restore / erase (engine/serve/state_task.py).

They share this base: a queue of their own kind of task, filled at the engine loop's door; the
cancelled tasks dropped at each step; every waiting task failed when an iteration raised or the
server shuts down. A runner is given the context, the scheduler's slots and its stats, never the
scheduler, so it cannot reach into the batching it stays out of.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Generic, TypeVar

from ubatch.engine.context.context import Context
from ubatch.engine.errors import EngineError
from ubatch.engine.serve.slot import Slot
from ubatch.engine.serve.stats import SchedulerStats
from ubatch.engine.serve.task import Job

J = TypeVar("J", bound=Job)


class SideRunner(ABC, Generic[J]):
    def __init__(self, kind: type[J], ctx: Context, slots: Sequence[Slot], stats: SchedulerStats) -> None:
        self.kind, self.ctx, self.slots, self.stats = kind, ctx, slots, stats
        self.pending: deque[J] = deque()  # taken at the door, waiting for their turn or their slot

    def accept(self, task: Job) -> bool:
        """Keep `task` if it is this runner's kind."""
        if not isinstance(task, self.kind):
            return False
        self.pending.append(task)
        return True

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    @property
    def n_waiting(self) -> int:
        return len(self.pending)

    def step(self) -> None:
        """Drop the tasks whose client went away, then run what can run now."""
        live = deque(t for t in self.pending if not t.cancelled)
        self.stats.n_cancelled += len(self.pending) - len(live)
        self.pending = live
        if live:
            self.run()

    @abstractmethod
    def run(self) -> None:
        """Run the waiting tasks that can run in this iteration; leave the others in `pending`."""

    def fail(self, err: EngineError) -> None:
        """Fail every waiting task (an iteration raised, or the server is shutting down)."""
        while self.pending:
            self.pending.popleft().fail(err)

    drain = fail  # at shutdown a task that has not run has nothing to return
