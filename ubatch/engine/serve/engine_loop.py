"""The engine thread, the thread-safe door into it, and shutdown.

HTTP handlers submit and cancel tasks from the event loop's thread while one engine thread owns
the context: every decode, every KV-cache change and every slot change happens there, so the
engine needs no locks of its own. `EngineLoop` is that thread and its door: `submit` and
`cancel` are safe from any thread. Each iteration hands the tasks that came in to their worker
(the scheduler takes completions, a side runner embeddings or slot files), then steps the side
runners and the scheduler, in that order, through the small `Worker` interface; it knows
nothing of slots or batches. The server's run code assembles it (cli/server/run.py).

Shutdown (llama-server's terminate on SIGTERM / SIGINT) is one more event through the same
door: from then on `submit` answers "unavailable" at once, and the engine thread, between two
iterations, drains every worker (a generating task ends with its text so far, the others fail),
then exits. So a server stops within one iteration whatever `n_predict` is, and every client
gets an answer.

A burst of requests is planned together. The HTTP side marks each completion request it has
received but not yet submitted (`arrival`, from reading the body to the submit: the template,
the tokenizing and the parameters on the request workers). When the engine is idle and a task
comes in while others are still arriving, it waits for them, at most `ADMIT_WAIT_S`, before it
steps: so 16 requests sent at once start in one batch instead of the first alone and the rest
one (prefill) step later. Nothing running is delayed by it: with a slot busy, the step runs at
once and late prompts join the next one, llama-server's policy (decode rows first, prompt
chunks fill the rest of n_batch, engine/serve/slot_batch.py).

What the HTTP side shows of the engine (`/slots`, `/metrics`, `/engine`) it asks for through
the same door: `snapshot` has the engine thread build one (engine/serve/snapshot.py) at its next
iteration boundary, or at once when it is idle, and hands back that value.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

from ubatch.engine.errors import EngineDown, EngineError, ErrorKind
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.serve.snapshot import DecodeWatch, Snapshot, take
from ubatch.engine.serve.task import Job


class Worker(Protocol):
    """What the engine loop drives: the scheduler and each side runner."""

    def accept(self, task: Job) -> bool: ...  # keep the task if it is this worker's kind

    @property
    def busy(self) -> bool: ...  # work that needs further iterations

    @property
    def n_waiting(self) -> int: ...  # tasks not started yet (/metrics' requests_deferred)

    def step(self) -> object: ...  # one iteration's work

    def fail(self, err: EngineError) -> None: ...  # its step raised: fail the work in progress

    def drain(self, err: EngineError) -> None: ...  # shutdown: end or fail every task it holds


# How long an idle engine waits for requests still being prepared before it plans without them:
# a normal request's preparation takes a few ms, a hostile one's may take seconds.
ADMIT_WAIT_S = 0.05


def shutdown_error() -> EngineError:
    """What a task that cannot run any more is told (llama-server's 503 unavailable_error)."""
    return EngineError(ErrorKind.UNAVAILABLE, "Server is shutting down")


def _internal(e: Exception) -> EngineError:
    return EngineError(ErrorKind.INTERNAL, f"internal error: {e}")


class EngineLoop:
    def __init__(
        self, scheduler: Scheduler, runners: Sequence[Worker] = (), admit_wait_s: float = ADMIT_WAIT_S
    ) -> None:
        self.scheduler = scheduler  # its stats count the requests; its iteration dates a cancel
        self.workers: tuple[Worker, ...] = (*runners, scheduler)  # stepped in this order
        self._incoming: deque[Job] = deque()
        self._cv = threading.Condition()
        self._shutdown = False
        self._thread: threading.Thread | None = None
        # the engine cannot go on (a tensor-parallel rank is gone): held tasks get 503, then this
        self.down: EngineDown | None = None
        self.on_down: Callable[[EngineDown], None] | None = None
        self._want_snapshot = False  # a reader waits for the next one
        self._snapshot: Snapshot | None = None
        self._n_snapshots = 0
        self.watch = DecodeWatch()  # on the context while someone watches the decodes
        self._n_watchers = 0
        self._n_arriving = 0  # requests between their body and their submit (`arrival`)
        self.admit_wait_s = admit_wait_s
        self.n_admit_waits = 0  # idle starts that waited for arriving requests

    @property
    def shutting_down(self) -> bool:
        return self._shutdown

    def start(self) -> None:
        self._snapshot = self._take()  # the engine thread is not running yet: readers start from this
        self._thread = threading.Thread(target=self._run, name="ubatch-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Take no more work and end what is in progress at the next iteration boundary; returns
        at once (safe from any thread). `stop` then waits for the engine thread."""
        with self._cv:
            self._shutdown = True
            self._cv.notify_all()

    def stop(self) -> None:
        self.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, task: Job) -> None:
        with self._cv:
            self.scheduler.stats.n_requests += 1
            if self._shutdown:  # the engine thread may be gone: answer here
                task.fail(shutdown_error())
                return
            self._incoming.append(task)
            self._cv.notify_all()

    @contextmanager
    def arrival(self) -> Iterator[None]:
        """A request that will submit tasks is being prepared (from any thread): an idle engine
        waits for it, briefly, so that a burst starts in one batch. Ends at the block's end,
        submitted or failed."""
        with self._cv:
            self._n_arriving += 1
        try:
            yield
        finally:
            with self._cv:
                self._n_arriving -= 1
                self._cv.notify_all()

    @property
    def n_arriving(self) -> int:
        return self._n_arriving

    def cancel(self, task: Job) -> None:
        """The client went away: its slot and cells are freed at the start of the next iteration."""
        if task.cancelled:
            return
        with self._cv:
            task.cancel_iteration = self.scheduler.iteration
            task.cancelled = True
            self._cv.notify_all()

    @property
    def n_deferred(self) -> int:
        return len(self._incoming) + sum(w.n_waiting for w in self.workers)

    # -- LoRA scales: the server's global ones (GET/POST /lora-adapters) ------------------------------
    def lora_scales(self) -> dict[int, float]:
        """The global scales of the loaded adapters (every adapter listed, 0 where not applied)."""
        ctx = self.scheduler.ctx
        return {i: ctx.lora.get(i, 0.0) for i in range(len(ctx.model.adapters))}

    def set_lora_scales(self, scales: dict[int, float]) -> None:
        """New global scales, unlisted adapters at 0 (llama-server's construct_lora_list). One dict
        swapped in under the loop's lock; a task copies the scales when it starts, so running
        ones keep theirs."""
        with self._cv:
            self.scheduler.ctx.set_adapters(scales)

    def snapshot(self, timeout_s: float = 5.0) -> Snapshot:
        """The engine's state as the engine thread sees it at its next iteration boundary (from
        any thread; blocks until then). An iteration longer than `timeout_s` (a long prompt on a
        slow machine) answers the last snapshot taken instead."""
        with self._cv:
            if not self._engine_running():  # nothing moves: read it here
                return self._take()
            n = self._n_snapshots
            self._want_snapshot = True
            self._cv.notify_all()
            deadline = time.monotonic() + timeout_s
            while self._n_snapshots == n and self._engine_running():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.1))
            if self._n_snapshots == n and not self._engine_running():
                return self._take()
            assert self._snapshot is not None  # taken in start()
            return self._snapshot

    def watch_decodes(self, on: bool) -> None:
        """A watcher of the decode calls came (`on`) or left: the observer is on the context
        while anyone watches. The context's list is replaced, never changed, so the engine
        thread's loop over the old one is not disturbed."""
        with self._cv:
            self._n_watchers = self._n_watchers + 1 if on else max(0, self._n_watchers - 1)
            ctx = self.scheduler.ctx
            if self._n_watchers and self.watch not in ctx.observers:
                ctx.observers = [*ctx.observers, self.watch]
            elif not self._n_watchers:
                ctx.observers = [o for o in ctx.observers if o is not self.watch]

    def _engine_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and threading.current_thread() is not self._thread

    def _take(self) -> Snapshot:
        return take(self.scheduler, self.n_deferred, self.watch if self._n_watchers else None)

    def _publish(self) -> None:
        """On the engine thread, between iterations: the snapshot a reader waits for."""
        snap = self._take()
        with self._cv:
            self._snapshot, self._want_snapshot = snap, False
            self._n_snapshots += 1
            self._cv.notify_all()

    def iterate(self) -> None:
        """One iteration on the calling thread: hand out what came in, step every worker. A
        worker whose step raises fails its own tasks; the others and the server go on."""
        self._hand_out()
        for w in self.workers:
            try:
                w.step()
            except EngineDown as e:  # nothing can run any more: stop taking work, answer the rest
                self.down = e
                w.fail(EngineError(ErrorKind.UNAVAILABLE, str(e)))
                self.shutdown()
                return
            except Exception as e:
                w.fail(_internal(e))

    def _hand_out(self) -> None:
        with self._cv:
            tasks, self._incoming = self._incoming, deque()
        for t in tasks:
            if not any(w.accept(t) for w in self.workers):
                t.fail(EngineError(ErrorKind.INTERNAL, f"internal error: no worker runs {type(t).__name__}"))

    def _admit(self) -> None:
        """Under the lock, the engine idle and a task in: wait while other requests are still
        being prepared (at most `admit_wait_s`), so that they join the first step."""
        self.n_admit_waits += 1
        deadline = time.monotonic() + self.admit_wait_s
        while self._n_arriving and not self._shutdown and (left := deadline - time.monotonic()) > 0:
            self._cv.wait(left)

    def _run(self) -> None:
        # no autograd anywhere on this thread: the context then skips entering inference mode per ubatch
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (
                    not self._shutdown
                    and not self._incoming
                    and not self._want_snapshot
                    and not any(w.busy for w in self.workers)
                ):
                    self._cv.wait()
                if self._shutdown:
                    break
                busy = any(w.busy for w in self.workers)
                if self._incoming and self._n_arriving and not busy:
                    self._admit()
                work = bool(self._incoming) or busy
            if work:
                self.iterate()
            if self._want_snapshot:
                self._publish()
        self._hand_out()  # nothing is submitted after shutdown: what came in is drained too
        err = shutdown_error() if self.down is None else EngineError(ErrorKind.UNAVAILABLE, str(self.down))
        for w in self.workers:
            try:
                if self.down is not None:  # nothing ends "as if it reached n_predict": all get 503
                    w.fail(err)
                w.drain(err)
            except Exception as e:
                w.fail(_internal(e))
        if self.down is not None and self.on_down is not None:
            self.on_down(self.down)
