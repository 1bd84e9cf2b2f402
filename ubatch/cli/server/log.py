"""The access/error log of `ubatch server`, and the last guard around every request.

llama-server logs each finished request at INFO ("done request: METHOD PATH ADDR STATUS"); this
line also carries the tokens the engine read and generated (known from the request's Final
events, which `Reader` in cli/server/stream.py adds to the `current()` record) and the time the
request took. Successful requests are quiet unless `-lv 4` (llama.cpp's debug level), and the
routes clients poll (/health, /models, /props, /metrics) stay quiet as in llama-server (their
503 while loading or stopping too: saying "not ready" is what they are for). A failed
request is logged at every verbosity with its cause, in one line: a 4xx/5xx (the message of its
error JSON) or a stream that ended in an error event.

Being the outermost middleware, it is also where an exception that escaped a route stops: it
becomes llama-server's 500 JSON (or, once a stream has started, an error event that ends it)
and one log line, never an ASGI traceback; a request the server stopped waiting for at shutdown
(a client slower than the grace period) gets the shutdown's 503 the same way.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from ubatch.cli.common import err_console
from ubatch.cli.server.http import error_body, error_event, error_response
from ubatch.engine.errors import EngineError, ErrorKind
from ubatch.engine.serve.engine_loop import shutdown_error

LOG_LEVEL_INFO, LOG_LEVEL_DEBUG = 3, 4  # llama.cpp's common/log.h levels; -lv defaults to INFO
POLLED_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/props", "/metrics"})
_MAX_ERROR_BODY = 16384  # enough for any error JSON; never buffer a whole response


def log(line: str) -> None:
    """One server log line on stderr, as llama-server writes its log."""
    err_console.print(line, markup=False, highlight=False, soft_wrap=True)


@dataclass(slots=True)
class RequestRecord:
    """What the log line of one request says; filled in while the request runs."""

    method: str
    path: str
    client: str
    t_start: float = field(default_factory=time.perf_counter)
    status: int = 0
    n_finals: int = 0
    n_prompt: int = 0
    n_predicted: int = 0
    error: str = ""  # the cause of a failure, one line
    note: str = ""  # e.g. "client disconnected"
    sse: bool = False
    body: bytearray = field(default_factory=bytearray)

    def add_final(self, n_prompt: int, n_predicted: int) -> None:
        self.n_finals += 1
        self.n_prompt += n_prompt
        self.n_predicted += n_predicted

    def fail(self, message: str) -> None:
        """A failure after the status was sent (an error event in a stream); the first cause wins."""
        if not self.error:
            self.error = _one_line(message)

    @property
    def failed(self) -> bool:
        return self.status >= 400 or bool(self.error)

    def line(self) -> str:
        ms = (time.perf_counter() - self.t_start) * 1e3
        parts = [f"srv  log_server_r: request: {self.method} {self.path} {self.client} {self.status}"]
        if self.n_finals:
            parts.append(f"n_prompt = {self.n_prompt}, n_predicted = {self.n_predicted}")
        parts.append(f"{ms:.1f} ms")
        if self.failed:
            parts.append(f"error: {self.error or self._cause()}")
        if self.note:
            parts.append(self.note)
        return " | ".join(parts)

    def _cause(self) -> str:
        """The message of the error JSON that was sent, else the status' phrase."""
        try:
            return _one_line(str(json.loads(bytes(self.body))["error"]["message"]))
        except (ValueError, KeyError, TypeError):
            pass
        if self.status == 499:
            return "client disconnected"
        try:
            return HTTPStatus(self.status).phrase
        except ValueError:
            return f"status {self.status}"


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


_current: ContextVar[RequestRecord | None] = ContextVar("ubatch_request", default=None)


def current() -> RequestRecord | None:
    """The record of the request this coroutine serves (None outside the access log)."""
    return _current.get()


class AccessLog:
    """ASGI middleware: one line per request, errors always; `verbosity` None logs nothing
    (--log-disable) but still guards the requests."""

    def __init__(self, app: Any, verbosity: int | None = LOG_LEVEL_INFO, write: Callable[[str], None] = log) -> None:
        self.app, self.verbosity, self.write = app, verbosity, write

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = (scope.get("client") or ("-", 0))[0]
        rec = RequestRecord(scope["method"], scope["path"], host)
        token = _current.set(rec)
        done = logged = False

        async def send_logged(message: dict[str, Any]) -> None:
            nonlocal done, logged
            if message["type"] == "http.response.start":
                rec.status = message["status"]
                rec.sse = any(
                    k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"]
                )
            elif message["type"] == "http.response.body":
                if rec.status >= 400 and len(rec.body) < _MAX_ERROR_BODY:
                    rec.body += message.get("body", b"")[:_MAX_ERROR_BODY]
                done = not message.get("more_body", False)
                if done:  # written before the last bytes leave, while the client still waits for them
                    logged = True
                    self._log(rec)
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        except asyncio.CancelledError:  # the server stopped waiting for this request (shutdown)
            logged = False
            rec.note = "cancelled at shutdown"
            rec.fail("the server shut down before the response was complete")
            await self._answer_failure(rec, shutdown_error(), done, receive, send)
        except Exception as e:  # a bug in a route: the client still gets an answer
            logged = False
            rec.fail(f"{type(e).__name__}: {e}")
            await self._answer_failure(rec, EngineError(ErrorKind.INTERNAL, rec.error), done, receive, send)
        finally:
            _current.reset(token)
            if not logged:
                self._log(rec)

    async def _answer_failure(self, rec: RequestRecord, err: EngineError, done: bool, receive: Any, send: Any) -> None:
        try:
            if not rec.status:  # nothing sent yet: llama-server's error JSON
                rec.status = error_body(err)[0]
                await error_response(err)({"type": "http"}, receive, send)
            elif not done:  # a stream: end it with an error event; other bodies just end
                chunk = error_event(err) if rec.sse else b""
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
        except Exception:  # the client is gone: nothing left to tell it
            pass

    def _log(self, rec: RequestRecord) -> None:
        if self.verbosity is None:
            return
        polled = rec.path in POLLED_PATHS
        if polled and rec.status == 503:  # /health saying "not ready" is its job, not a failure
            return
        if rec.failed or (self.verbosity >= LOG_LEVEL_DEBUG and not polled):
            try:
                self.write(rec.line())
            except Exception:  # logging must never fail a request
                pass
