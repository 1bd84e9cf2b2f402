"""uvicorn's h11 connection as llama-server's socket behaves: a header deadline, and response
header names in llama-server's case.

Header names: ASGI apps (Starlette, uvicorn) write them lower-case, and h11 sends the names it is
given; llama-server (cpp-httplib) sends `Content-Type`, `Access-Control-Allow-Origin`,
`Process-Start-Time-Unix`... A client that reads the head into a case-sensitive map finds only
those, so each name leaves here in that case (`canonical_name`).

Header deadline: a connection whose request headers are not complete within the timeout is
closed.

uvicorn times a keep-alive connection only while it is idle between requests, and stops the
timer at the first byte of the next request; a client that connects and never finishes its
headers (slowloris) would hold its socket for ever. Here a deadline starts when a connection
opens, and again at the first byte of each later request, and ends when h11 has the headers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

# names whose llama-server spelling is not one capital per dash-separated word
_SPELLED = {b"etag": b"ETag", b"www-authenticate": b"WWW-Authenticate"}


def canonical_name(name: bytes) -> bytes:
    """A response header name as llama-server spells it: `content-type` -> `Content-Type`."""
    low = name.lower()
    return _SPELLED.get(low) or b"-".join(w[:1].upper() + w[1:] for w in low.split(b"-"))


class CanonicalCaseConnection(h11.Connection):
    """h11's server connection writing response header names in llama-server's case; h11 keeps
    a name's bytes as given (it lowercases only to compare), so renaming before h11 sees the
    event is enough. Headers h11 adds itself (Transfer-Encoding, Connection) it title-cases."""

    def send_with_data_passthrough(self, event: h11.Event) -> list[bytes] | None:
        if isinstance(event, h11.Response | h11.InformationalResponse):
            event = type(event)(
                status_code=event.status_code,
                headers=[(canonical_name(n), v) for n, v in event.headers.raw_items()],
                reason=event.reason,
                http_version=event.http_version,
            )
        return super().send_with_data_passthrough(event)


class HeaderDeadlineH11(H11Protocol):
    """H11Protocol plus the header deadline and llama-server's header case;
    `header_timeout_s` is set by `guarded_h11`."""

    header_timeout_s: float = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size
        self.conn = CanonicalCaseConnection(h11.SERVER, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn narrows it
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still reading headers (or idle): keep a deadline
            if self._deadline is None and not self.transport.is_closing():
                self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no request under way: nobody to answer


def guarded_h11(header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), closing header-less connections after
    `header_timeout_s` seconds and sending header names in llama-server's case."""
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout_s": float(header_timeout_s)})
