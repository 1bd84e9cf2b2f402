"""The thread the engine runs on, and the thread-safe door into it.

HTTP handlers submit and cancel tasks from the event loop's thread while one engine thread owns
the context: every decode, every KV-cache change and every slot happen there, so the engine
needs no locks of its own. This base class is that door (`submit`, `cancel`, `start`,
`shutdown`, `stop`); the scheduler supplies `step`, one iteration of work, and `_drain`, what
shutting down does to the work in progress.

Shutdown (llama-server's terminate on SIGTERM / SIGINT) is one more event through the same
door: from then on `submit` answers 503 at once, and the engine thread, between two iterations,
ends every running task and fails every queued one, then exits. So a server stops within one
iteration whatever `n_predict` is, and every client gets an answer.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from ubatch.engine.serve.embedding_task import EmbeddingRunner
from ubatch.engine.serve.state_task import StateRunner
from ubatch.engine.serve.stats import SchedulerStats
from ubatch.engine.serve.task import Failed, RequestError, Task

if TYPE_CHECKING:
    from ubatch.engine.context.context import Context


def shutdown_error() -> RequestError:
    """What a task that cannot run any more is told: llama-server's 503 unavailable_error."""
    return RequestError("Server is shutting down", 503, "unavailable_error")


class EngineThread:
    stats: SchedulerStats

    def __init__(self, ctx: Context) -> None:
        # tasks that run beside continuous batching, each iteration before it: slot save/restore
        # (engine/state_task.py), then embedding and rerank tasks (engine/embedding_task.py)
        self.slot_actions = StateRunner()
        self.embeddings = EmbeddingRunner(ctx)
        self.side_runners: tuple[StateRunner | EmbeddingRunner, ...] = (self.slot_actions, self.embeddings)
        self.iteration = 0
        self.queue: deque[Task] = deque()  # accepted, waiting for a slot (only the engine thread touches it)
        self._incoming: deque[Task] = deque()
        self._cv = threading.Condition()
        self._shutdown = False
        self._thread: threading.Thread | None = None

    def step(self) -> Any:  # one iteration, on the engine thread
        raise NotImplementedError

    def _busy(self) -> bool:  # work in progress that needs further iterations
        raise NotImplementedError

    def _fail_all(self, e: Exception) -> None:  # an iteration raised: fail what was running
        raise NotImplementedError

    def _drain(self) -> None:  # shutdown: end running tasks, fail queued ones (engine thread)
        raise NotImplementedError

    @property
    def shutting_down(self) -> bool:
        return self._shutdown

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ubatch-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Take no more work and end what is in progress at the next iteration boundary; returns
        at once (safe from any thread). `stop` then waits for the engine thread."""
        with self._cv:
            self._shutdown = True
            self._cv.notify()

    def stop(self) -> None:
        self.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, task: Task) -> None:
        with self._cv:
            self.stats.n_requests += 1
            if self._shutdown:  # the engine thread may be gone: answer here
                task.emit(Failed(task, shutdown_error()))
                return
            self._incoming.append(task)
            self._cv.notify()

    def cancel(self, task: Task) -> None:
        """The client went away: its slot and cells are freed at the start of the next iteration."""
        if task.cancelled:
            return
        with self._cv:
            task.cancel_iteration = self.iteration
            task.cancelled = True
            self._cv.notify()

    @property
    def n_deferred(self) -> int:
        return len(self.queue) + len(self._incoming) + sum(len(r.pending) for r in self.side_runners)

    def _run(self) -> None:
        while True:
            with self._cv:
                while (
                    not self._shutdown
                    and not self._incoming
                    and not self.queue
                    and not self._busy()
                    and not any(r.busy for r in self.side_runners)
                ):
                    self._cv.wait()
                if self._shutdown:  # nothing can be submitted after this: take what came in
                    self.queue.extend(self._incoming)
                    self._incoming.clear()
                    break
            try:
                self.step()
            except Exception as e:  # a bug in an iteration fails its requests, not the server
                self._fail_all(e)
        try:
            for r in self.side_runners:
                r.fail_pending(shutdown_error())
            self._drain()
        except Exception as e:
            self._fail_all(e)
