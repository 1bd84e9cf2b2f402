"""Resumable streams, as llama-server has them (server-stream.cpp): a streamed completion sent
with an `X-Conversation-Id` header keeps running when its client goes away (a page reload), and
its SSE bytes are kept so a client can read them again from any offset.

* `GET /v1/stream?conv_id=ID&from=N` replays the bytes from offset N, then follows the live
  stream until it ends;
* `POST /v1/streams/lookup` `{"conversation_ids": [...]}` says which of those ids (or their
  `ID::model` variants) have a session: only ids the caller names, never a listing;
* `DELETE /v1/stream?conv_id=ID` is the user's Stop: the generation is cancelled and the
  bytes are dropped (204, also for an unknown id).

One conversation has at most one session: a new stream for it cancels the previous one. A
session keeps its last 4 MiB and is dropped 300 s after its stream ended. Everything here runs
on the event loop, so sessions need no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ubatch.cli.server.http import api, bad_request, read_json
from ubatch.engine.errors import EngineError, ErrorKind

SESSION_TTL_S = 300
SESSION_MAX_BYTES = 4 * 1024 * 1024


class StreamSession:
    """The SSE bytes of one conversation's stream: a window of the last SESSION_MAX_BYTES."""

    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        self.started_at = int(time.time())
        self.completed_at = 0  # unix seconds once finished
        self.buf = bytearray()
        self.dropped = 0  # bytes evicted from the front
        self.done = self.cancelled = False
        self.on_cancel: Callable[[], None] | None = None  # the producer's: cancel its tasks
        self._wake = asyncio.Event()

    @property
    def total(self) -> int:
        return self.dropped + len(self.buf)

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self.buf += data
        if len(self.buf) > SESSION_MAX_BYTES:
            cut = len(self.buf) - SESSION_MAX_BYTES
            del self.buf[:cut]
            self.dropped += cut
        self._notify()

    def finalize(self) -> None:
        if not self.done:
            self.done, self.completed_at = True, int(time.time())
            self._notify()

    def cancel(self) -> None:
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()
        self.finalize()

    async def read_from(self, offset: int) -> AsyncIterator[bytes]:
        """The bytes from `offset` on, waiting for more until the session is finished."""
        while True:
            if offset < self.dropped:
                return
            if offset < self.total:
                chunk = bytes(self.buf[offset - self.dropped :])
                offset += len(chunk)
                yield chunk
                continue
            if self.done:
                return
            await self._wake.wait()


class StreamSessions:
    """The live sessions of one server, by conversation id."""

    def __init__(self) -> None:
        self.sessions: dict[str, StreamSession] = {}

    def _expire(self) -> None:
        cutoff = time.time() - SESSION_TTL_S
        for k in [k for k, s in self.sessions.items() if s.completed_at and s.completed_at <= cutoff]:
            del self.sessions[k]

    def create_or_replace(self, conversation_id: str) -> StreamSession:
        self._expire()
        previous = self.sessions.get(conversation_id)
        self.sessions[conversation_id] = s = StreamSession(conversation_id)
        if previous is not None:
            previous.cancel()
        return s

    def get(self, conversation_id: str) -> StreamSession | None:
        self._expire()
        return self.sessions.get(conversation_id)

    def stop(self, conversation_id: str) -> None:
        s = self.sessions.pop(conversation_id, None)
        if s is not None:
            s.cancel()

    def lookup(self, ids: list[str]) -> list[dict[str, Any]]:
        self._expire()
        out = []
        for rid in ids:
            for s in self.sessions.values():
                if s.conversation_id == rid or s.conversation_id.startswith(rid + "::"):
                    out.append(
                        {
                            "conversation_id": s.conversation_id,
                            "is_done": s.done,
                            "total_bytes": s.total,
                            "started_at": s.started_at,
                            "completed_at": s.completed_at,
                        }
                    )
        return out


def _conv_id(request: Request) -> str:
    cid = request.query_params.get("conv_id", "")
    if not cid:
        raise bad_request("Missing conversation id in path")
    return cid


def add_resume_routes(app: FastAPI, streams: StreamSessions) -> None:
    @app.get("/v1/stream")
    @api
    async def replay(request: Request) -> Response:
        s = streams.get(_conv_id(request))
        if s is None:
            raise EngineError(ErrorKind.NOT_FOUND, "File Not Found")  # what llama-server sends
        raw = request.query_params.get("from", "")
        try:
            start = int(raw) if raw else 0
            if start < 0:
                raise ValueError
        except ValueError:
            raise bad_request("Invalid 'from' offset") from None
        if start < s.dropped:
            raise bad_request("Stream offset lost, please restart")
        return StreamingResponse(s.read_from(start), media_type="text/event-stream")

    @app.post("/v1/streams/lookup")
    @api
    async def lookup(request: Request) -> Response:
        body = await read_json(request)
        ids = body.get("conversation_ids") if isinstance(body, dict) else None
        wanted = [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []
        return JSONResponse(streams.lookup(wanted))

    @app.delete("/v1/stream")
    @api
    async def stop(request: Request) -> Response:
        streams.stop(_conv_id(request))
        return Response(status_code=204)
