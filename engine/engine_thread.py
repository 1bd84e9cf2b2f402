"""The thread the engine runs on, and the thread-safe door into it.

HTTP handlers submit and cancel tasks from the event loop's thread while one engine thread owns
the context: every decode, every KV-cache change and every slot happen there, so the engine
needs no locks of its own. This base class is that door (`submit`, `cancel`, `start`, `stop`);
the scheduler supplies `step`, one iteration of work.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from .server_stats import SchedulerStats
from .server_task import Task


class EngineThread:
    stats: SchedulerStats

    def __init__(self) -> None:
        self.iteration = 0
        self.queue: deque[Task] = deque()  # accepted, waiting for a slot (only the engine thread touches it)
        self._incoming: deque[Task] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def step(self) -> Any:  # one iteration, on the engine thread
        raise NotImplementedError

    def _busy(self) -> bool:  # work in progress that needs further iterations
        raise NotImplementedError

    def _fail_all(self, e: Exception) -> None:  # an iteration raised: fail what was running
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ubatch-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, task: Task) -> None:
        with self._cv:
            self.stats.n_requests += 1
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
        return len(self.queue) + len(self._incoming)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._incoming and not self.queue and not self._busy():
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a bug in an iteration fails its requests, not the server
                self._fail_all(e)
