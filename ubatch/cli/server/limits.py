"""What one hostile request may cost `ubatch server`: the size of its body, how long its bytes may
take to arrive, how deeply its JSON nests, and the worker threads that do its heavy work.

llama-server reads requests on a thread pool, so one slow request never stops another; here one
event loop serves every client, so anything heavier than I/O (parsing a large body, tokenizing,
compiling a grammar, rendering a chat template) runs on `off_loop`'s bounded pool, and anything
unbounded (a body, a header, a nesting depth) has a limit with a flag (cli/server/command.py).
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

import numpy as np
from starlette.responses import JSONResponse
from starlette.types import Message

from ubatch.cli.server import responses as sj

P = ParamSpec("P")
T = TypeVar("T")

REQUEST_WORKERS = 4  # heavy request work at once; more waits its turn (the GIL runs one anyway)
INLINE_PARSE_BYTES = 64 * 1024  # smaller bodies parse on the loop: less than a millisecond
_DEPTH_CHUNK = 1 << 20  # bytes scanned per numpy step: bounded temporary arrays

_pool = ThreadPoolExecutor(max_workers=REQUEST_WORKERS, thread_name_prefix="ubatch-request")


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run `fn` on the request workers and await it, so the event loop keeps serving others.
    A cancelled await (the client left) lets the call finish on its own: its result is dropped."""
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args, **kwargs))


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
