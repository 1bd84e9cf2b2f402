"""What one hostile request may cost `ubatch server`: the size of its body, how long its bytes may
take to arrive, how deeply its JSON nests, and the worker threads that do its heavy work.

llama-server reads requests on a thread pool, so one slow request never stops another; here one
event loop serves every client, so anything heavier than I/O runs on worker threads, and anything
unbounded (a body, a header, a nesting depth) has a limit with a flag (cli/server/command.py).

Two sets of workers: a request's preparation (rendering its chat template, converting its
schemas, compiling its grammar: up to a second of work for a hostile body) runs on its own
(`prepare_off_loop`), so however many such requests arrive they never occupy the workers that
the light work needs (tokenizing a short text, reading a reply's tool calls as it streams,
parsing a large body: `off_loop`). Each call runs in a cancel scope (engine/grammar/budget.py):
a preparation whose client leaves, and every call when the server stops (`cancel_all`), stops at
its next check. The workers are daemon threads, so the interpreter never waits for one at exit.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

import numpy as np
from starlette.responses import JSONResponse
from starlette.types import Message, Receive

from ubatch.cli.server import responses as sj
from ubatch.engine.errors import EngineError, ErrorKind
from ubatch.engine.grammar.budget import WorkCancelled, cancel_scope
from ubatch.engine.serve.engine_loop import shutdown_error

P = ParamSpec("P")
T = TypeVar("T")

REQUEST_WORKERS = 4  # light work off the loop at once; more waits its turn (the GIL runs one anyway)
# Request preparations at once, on workers of their own. More than the light ones: a worker
# waiting for its grammar's probing turn (engine/grammar/budget.py) holds no CPU, and a normal
# request's preparation should find a free worker while hostile ones wait.
PREPARE_WORKERS = 16
INLINE_PARSE_BYTES = 64 * 1024  # smaller bodies parse on the loop: less than a millisecond
_DEPTH_CHUNK = 1 << 20  # bytes scanned per numpy step: bounded temporary arrays


class Workers:
    """A fixed set of daemon threads running calls in the order submitted. Unlike a
    ThreadPoolExecutor's, the interpreter does not join them at exit: a stopping server exits
    in its shutdown timeout whatever one is doing."""

    def __init__(self, n: int, name: str) -> None:
        self.n, self.name = n, name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            while len(self._threads) < self.n:
                t = threading.Thread(target=self._serve, name=f"{self.name}-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)
        self._queue.put((fut, fn))
        return fut

    def _serve(self) -> None:
        while True:
            fut, fn = self._queue.get()
            if not fut.set_running_or_notify_cancel():  # its caller gave up while it waited
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller's to raise
                fut.set_exception(e)
            del fut, fn


_light = Workers(REQUEST_WORKERS, "ubatch-request")
_prepare = Workers(PREPARE_WORKERS, "ubatch-prepare")
_running: set[threading.Event] = set()  # the cancel events of the calls in progress
_stopping = threading.Event()


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run `fn` on the request workers and await it, so the event loop keeps serving others.
    A cancelled await cancels the call's grammar work (and drops its result)."""
    return await _await(_light, None, functools.partial(fn, *args, **kwargs))


async def prepare_off_loop(receive: Receive, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a request's preparation `fn` on the preparation workers; if the client disconnects
    first (`receive` says so), the work is cancelled and the request ends."""
    return await _await(_prepare, receive, functools.partial(fn, *args, **kwargs))


def cancel_all() -> None:
    """The server is stopping: every call in progress, and any later one, is cancelled."""
    _stopping.set()
    for cancel in list(_running):
        cancel.set()


async def _await(workers: Workers, receive: Receive | None, call: Callable[[], T]) -> T:
    cancel = threading.Event()
    _running.add(cancel)
    if _stopping.is_set():
        cancel.set()

    def run() -> T:
        with cancel_scope(cancel):
            return call()

    fut = asyncio.wrap_future(workers.submit(run))
    fut.add_done_callback(_retrieved)
    gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
    try:
        if gone is None:
            return await fut
        await asyncio.wait((fut, gone), return_when=asyncio.FIRST_COMPLETED)
        if not fut.done():
            cancel.set()
            fut.cancel()  # never started if it still waits for a worker
            raise _cancelled()
        return fut.result()
    except WorkCancelled:
        raise _cancelled() from None
    except asyncio.CancelledError:
        cancel.set()
        raise
    finally:
        if gone is not None:
            gone.cancel()
        _running.discard(cancel)


def _cancelled() -> EngineError:
    """What a cancelled call's request is answered (if anyone still listens)."""
    if _stopping.is_set():
        return shutdown_error()
    return EngineError(ErrorKind.INVALID_REQUEST, "Request cancelled: the client disconnected")


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """A result nobody awaits any more (the client left) is read, so asyncio does not log it."""
    if not fut.cancelled():
        fut.exception()


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the connection's receive fails: gone too)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:
        return


# a JSON string: its brackets are text, not nesting (an unterminated one is invalid JSON anyway)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


def json_too_deep(raw: bytes, limit: int) -> bool:
    """True when the JSON text `raw` nests arrays and objects deeper than `limit`. Iterative and
    in C (a regex and numpy), so a 100,000-deep body is refused in milliseconds rather than
    reaching the parser, whose recursion it would exhaust."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    a = np.frombuffer(_STRING.sub(b"", raw), np.uint8)
    depth = 0
    for i in range(0, len(a), _DEPTH_CHUNK):
        c = a[i : i + _DEPTH_CHUNK]
        step = (c == _OPEN[0]).astype(np.int32) + (c == _OPEN[1]) - (c == _CLOSE[0]) - (c == _CLOSE[1])
        run = np.cumsum(step, dtype=np.int64) + depth
        if int(run.max()) > limit:
            return True
        depth = int(run[-1])
    return False


def _error(code: int, message: str) -> JSONResponse:
    return JSONResponse(sj.error_json(code, message, "invalid_request_error"), status_code=code)


def body_too_large(limit: int) -> JSONResponse:
    return _error(
        413, f"Request body is larger than {limit} bytes: send less, or start the server with a larger --max-body-size"
    )


class BodyGuard:
    """ASGI middleware: reads each request's body up front, within `max_body` bytes (a larger
    Content-Length is a 413 before anything is read; a chunked body is cut at the limit) and
    `timeout_s` seconds between chunks (408), then hands the routes the body as one message.
    Later receive() calls reach the connection: the routes watch them for a disconnect."""

    def __init__(self, app: Any, max_body: int, timeout_s: float) -> None:
        self.app, self.max_body, self.timeout_s = app, max_body, timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope["headers"]:
            if k.lower() == b"content-length":
                try:
                    if int(v) > self.max_body:
                        await body_too_large(self.max_body)(scope, receive, send)
                        return
                except ValueError:
                    pass  # h11 refuses a bad Content-Length before the app sees it
        chunks, size = [], 0
        while True:
            try:
                message: Message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                msg = f"Request body not received within {self.timeout_s:g} s: send it at once, or raise -to"
                await _error(408, msg)(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client left before its body arrived
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await body_too_large(self.max_body)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
