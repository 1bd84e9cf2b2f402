"""How a request's events get from the engine thread to the client: the `Reader` that hands
them onto the event loop (and cancels the request's tasks when the client goes away), and the
server-sent-events stream of `"stream": true` completions.

Handlers never block the engine: they submit tasks through the engine loop's door and await
the events that the engine thread hands over with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive

from ubatch.cli.server import responses as sj
from ubatch.cli.server.http import error_event, error_response
from ubatch.cli.server.limits import off_loop
from ubatch.cli.server.log import current
from ubatch.cli.server.request.tools import ChatPlan
from ubatch.cli.server.resume import StreamSession
from ubatch.engine.chat.tools import ChatDelta, ChatMessageOut
from ubatch.engine.errors import EngineError
from ubatch.engine.serve.engine_loop import EngineLoop
from ubatch.engine.serve.task import Failed, Final, Job, Partial, Progress, Sink, with_prefill


class Reader:
    """One request's events, moved from the engine thread onto the event loop; watches for the
    client going away and then cancels the request's tasks. A shutdown reaches it as ordinary
    events: a Final for a generating task, a 503 Failed for one that had not started."""

    GONE = object()

    def __init__(self, engine: EngineLoop, receive: Receive) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.engine, self.tasks, self.gone = engine, list[Job](), False
        self.detached = False  # a resumable stream: generation goes on when the client leaves
        self.client_gone = self.closed = False
        self.record = current()  # this request's access-log line
        self._watcher = asyncio.ensure_future(self._watch(receive))

    def register(self, cmpl_id: str) -> None:
        """Make the request findable by its completion id while it runs."""
        _LIVE[cmpl_id] = self

    def sink(self, event: object) -> None:  # called on the engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (shutdown)
            pass

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        if not self.detached:
            self.disconnect()

    def disconnect(self) -> None:
        if not self.gone:
            self.gone = True
            for t in self.tasks:
                self.engine.cancel(t)
            self.queue.put_nowait(Reader.GONE)

    def close(self) -> None:
        self.closed = True
        self._watcher.cancel()

    def ending(self, ev: object, errors: Callable[[EngineError], Response] | None = None) -> Response | None:
        """The response that ends a request at `ev`, or None to go on: 499 when the client went
        away, the failure's error JSON (`errors` shapes it; llama-server's by default) after
        cancelling the request's other tasks. Either way the reader is closed."""
        if ev is Reader.GONE:
            self.close()
            return Response(status_code=499)
        if isinstance(ev, Failed):
            self.disconnect()
            self.close()
            return (errors or error_response)(ev.error)
        return None

    @staticmethod
    def stream_end(ev: object) -> bytes | None:
        """What ends a stream at `ev`, or None to go on: nothing more when the client went away
        (b""), the error event that closes it when its task failed."""
        if ev is Reader.GONE:
            return b""
        if isinstance(ev, Failed):
            return error_event(ev.error)
        return None

    async def get(self) -> Any:
        """The next event; what it tells the access log (tokens, a failure) is noted on the way."""
        ev = await self.queue.get()
        if self.record is not None:
            if isinstance(ev, Final):
                self.record.add_final(ev.n_prompt, ev.n_decoded)
            elif isinstance(ev, Failed):
                self.record.fail(ev.error.message)
            elif ev is Reader.GONE:
                self.record.note = "client disconnected"
        return ev


async def results(engine: EngineLoop, receive: Receive, make: Callable[[Sink], list[Job]]) -> list[object] | Response:
    """Submit the tasks `make` builds around a sink and await one result from each (in the
    order they come), or the response that ends the request: 499 when the client went away,
    the first failure's error JSON (the other tasks are cancelled)."""
    reader = Reader(engine, receive)
    try:
        reader.tasks = make(reader.sink)
        for t in reader.tasks:
            engine.submit(t)
        out: list[object] = []
        while len(out) < len(reader.tasks):
            ev = await reader.get()
            if ev is Reader.GONE:
                return Response(status_code=499)
            if isinstance(ev, Failed):
                reader.disconnect()
                return error_response(ev.error)
            out.append(ev)
        return out
    except BaseException:
        reader.disconnect()
        raise
    finally:
        reader.close()


_LIVE: weakref.WeakValueDictionary[str, Reader] = weakref.WeakValueDictionary()


def live_completion(cmpl_id: str) -> bool:
    """Whether a request with this completion id is still running."""
    r = _LIVE.get(cmpl_id)
    return r is not None and not r.closed


class EventStream(Response):
    """text/event-stream without Content-Length; a failed send counts as a disconnect. With a
    `session` (X-Conversation-Id) every chunk is also kept there, and the stream runs to its end
    when the client goes away, unless the session is stopped (DELETE /v1/stream)."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], reader: Reader, session: StreamSession | None = None) -> None:
        self.chunks, self.reader, self.session = chunks, reader, session
        self.status_code, self.background = 200, None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # llama-server: tell a proxy (nginx) not to buffer the stream
        ]
        reader.detached = session is not None

    async def _send(self, send: Any, message: dict[str, Any]) -> None:
        if self.reader.client_gone:
            return
        try:
            await send(message)
        except OSError:
            self.reader.client_gone = True
            if self.session is None:
                self.reader.disconnect()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        s = self.session
        if s is not None:
            s.on_cancel = self.reader.disconnect
        try:
            await self._send(send, {"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                if s is not None:
                    s.append(chunk)
                await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if s is not None:
                s.on_cancel = None
                s.finalize()
            self.reader.close()


async def sse_events(
    reader: Reader, ev: Any, kind: str, cid: str, model: str, prefill: str = "", plan: ChatPlan | None = None
) -> AsyncIterator[bytes]:
    """The SSE chunks of a streamed request, from its first event `ev` until every task has
    finished: native chunks for kind "native", OpenAI chunks (and `[DONE]`) for "oai" and "chat".
    `prefill` (a continued assistant message) starts each choice's first text; with a chat
    `plan` each choice's text is read as it grows (reasoning_content, tool_calls deltas)."""
    n_final, started = 0, set[int]()
    replies: dict[int, ReplyStream] = {}
    while True:
        if (end := Reader.stream_end(ev)) is not None:
            if end:
                yield end
            return
        if prefill and isinstance(ev, Partial | Final) and ev.task.index not in started:
            started.add(ev.task.index)
            ev = with_prefill(ev, prefill)
        if isinstance(ev, Progress) and kind == "native":
            chunks = [sj.native_progress(ev)]
        elif kind == "native":
            chunks = [sj.native_partial(ev) if isinstance(ev, Partial) else sj.native_final(ev, model)]
        elif kind == "oai":
            chunks = sj.oai_completion_chunk(ev, cid, model)
        elif plan is None or isinstance(ev, Progress):
            chunks = sj.oai_chat_chunks(ev, cid, model)
        else:
            reply = replies.setdefault(ev.task.index, ReplyStream(plan))
            deltas = await reply.feed(ev.text if isinstance(ev, Partial) else ev.content, isinstance(ev, Final))
            chunks = sj.oai_chat_chunks(ev, cid, model, deltas, reply.message)
        for c in chunks:
            yield sj.sse(c)
        if isinstance(ev, Final):
            n_final += 1
            if n_final == len(reader.tasks):
                if kind != "native":
                    yield b"data: [DONE]\n\n"
                return
        ev = await reader.get()


class ReplyStream:
    """One choice's streamed text read by its plan, piece by piece. The parser re-reads the
    text so far at every piece, so a long reply's pieces are read on the request workers."""

    INLINE_CHARS = 4096  # below this a re-read costs microseconds: done on the event loop

    def __init__(self, plan: ChatPlan) -> None:
        self.parser = plan.stream_parser()
        self.message: ChatMessageOut | None = None

    def _feed(self, text: str, last: bool) -> list[ChatDelta]:
        out = [self.parser.feed(text)]
        if last:
            out.append(self.parser.finish())
            self.message = self.parser.message
        return [d for d in out if d]

    async def feed(self, text: str, last: bool = False) -> list[ChatDelta]:
        """The deltas `text` makes sendable; `last`: the reply is whole (then `message` is set)."""
        if len(self.parser.text) + len(text) <= self.INLINE_CHARS:
            return self._feed(text, last)
        return await off_loop(self._feed, text, last)
