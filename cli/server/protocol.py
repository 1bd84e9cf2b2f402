"""uvicorn's h11 connection with a header deadline: a connection whose request headers are not
complete within the timeout is closed.

uvicorn times a keep-alive connection only while it is idle between requests, and stops the
timer at the first byte of the next request; a client that connects and never finishes its
headers (slowloris) would hold its socket for ever. Here a deadline starts when a connection
opens, and again at the first byte of each later request, and ends when h11 has the headers.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineH11(H11Protocol):
    """H11Protocol plus the header deadline; `header_timeout_s` is set by `guarded_h11`."""

    header_timeout_s: float = 30.0
    _deadline: asyncio.TimerHandle | None = None

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
    `header_timeout_s` seconds."""
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout_s": float(header_timeout_s)})
