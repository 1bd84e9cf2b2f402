"""`ubatch server` stopping on SIGTERM / SIGINT, and its access/error log, through the real CLI.

Each test has its own server, a subprocess on the tiny model (all started together, each stopped
by its test), and talks to it over loopback. `ignore_eos` with `n_predict` -1 makes a request
that only a shutdown ends before the context fills, and the slot's log line says which ended it
(`stop = shutdown`).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from ubatch.cli.server.log import AccessLog

ENDLESS = {"n_predict": -1, "ignore_eos": True, "temperature": 0}
SHUTDOWN_503 = {"code": 503, "message": "Server is shutting down", "type": "unavailable_error"}


class Server:
    """A `ubatch server` subprocess and the stderr lines it has written so far."""

    def __init__(self, model: Path, *flags: str) -> None:
        cmd = [sys.executable, "-m", "ubatch.cli.main", "server", "-m", str(model), "--port", "0", "-t", "1"]
        self.proc = subprocess.Popen(
            [*cmd, "-c", "2048", "--no-warmup", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")))  # type: ignore[union-attr]
        self._reader.start()
        port = self.wait_line(r"HTTP server is listening.*port: (\d+)").group(1)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.time() < deadline and self.proc.poll() is None, self.log
            time.sleep(0.05)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_line(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline = time.time() + timeout
        while True:
            m = next((m for x in list(self.lines) if (m := re.search(pattern, x))), None)
            if m is not None:
                return m
            assert time.time() < deadline and self.proc.poll() is None, f"no line {pattern!r} in:\n{self.log}"
            time.sleep(0.02)

    def slot_decoded(self, n: int) -> None:
        """Wait until slot 0 has generated at least n tokens."""
        deadline = time.time() + 30
        while httpx.get(self.url + "/slots").json()[0].get("next_token", [{"n_decoded": 0}])[0]["n_decoded"] < n:
            assert time.time() < deadline, self.log
            time.sleep(0.02)

    def signal_and_wait(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=10)
        self._reader.join(5)
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)


FLAGS = {"sigterm": ("-np", "1", "--metrics"), "sigint": ("-np", "1", "-lv", "4"), "second_signal": ("-np", "1")}


@pytest.fixture(scope="module")
def servers(tiny_gemma: Path) -> Iterator[dict[str, Server]]:
    """A server for each test below (each test stops its own), all started at once: a start is
    mostly a fresh Python importing torch, which a second core does beside the first."""
    with ThreadPoolExecutor(len(FLAGS)) as pool:
        futures = {k: pool.submit(Server, tiny_gemma, *flags) for k, flags in FLAGS.items()}
    started = {k: f.result() for k, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            f.result()  # one that did not start fails the tests
        yield started
    finally:
        for s in started.values():
            s.close()


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as e:  # reported by the test's asserts
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_sigterm_ends_a_stream_answers_the_queue_503_and_logs_failures(servers: dict[str, Server]) -> None:
    srv = servers["sigterm"]
    bad = httpx.post(srv.url + "/completion", content=b"{not json", headers={"Content-Type": "application/json"})
    missing = httpx.get(srv.url + "/no/such/route")
    ok = httpx.post(srv.url + "/completion", json={"prompt": "a", "n_predict": 2})
    assert (bad.status_code, missing.status_code, ok.status_code) == (400, 404, 200)
    events: list[dict[str, Any]] = []

    def stream() -> None:
        body = {"prompt": "Once upon a time", "stream": True, **ENDLESS}
        with httpx.stream("POST", srv.url + "/completion", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    streaming, s_out = in_thread(stream)
    srv.slot_decoded(3)
    # a second request waits for the only slot
    queued, q_out = in_thread(lambda: httpx.post(srv.url + "/completion", json={"prompt": "x"}, timeout=30))
    deadline = time.time() + 30
    while "llamacpp:requests_deferred 1" not in httpx.get(srv.url + "/metrics").text:
        assert time.time() < deadline, srv.log
        time.sleep(0.02)
    rc = srv.signal_and_wait(signal.SIGTERM)
    streaming.join(10)
    queued.join(10)
    assert rc == 0, srv.log
    assert "error" not in s_out and "error" not in q_out, (s_out, q_out)
    last = events[-1]
    assert last["stop"] is True and last["stop_type"] == "limit", last
    assert all(not e["stop"] for e in events[:-1]) and len(events) > 3
    assert "stop = shutdown" in srv.log  # the slot was ended by the shutdown, not by its context
    r = q_out["result"]
    assert (r.status_code, r.json()) == (503, {"error": SHUTDOWN_503})
    assert "Traceback" not in srv.log
    # quiet by default: the 200s have no access line; each failure has one, with its cause
    access = [x for x in srv.lines if "log_server_r" in x]
    assert len(access) == 3, access
    bad_line, missing_line, queued_line = access
    assert "POST /completion 127.0.0.1 400 | " in bad_line and "error: Invalid JSON in the request body" in bad_line
    assert "GET /no/such/route 127.0.0.1 404 | " in missing_line and "error: File Not Found" in missing_line
    assert "POST /completion 127.0.0.1 503 | " in queued_line and "error: Server is shutting down" in queued_line


def test_sigint_gives_a_non_streaming_request_its_partial_result(servers: dict[str, Server]) -> None:
    srv = servers["sigint"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1, **ENDLESS}
    request, out = in_thread(lambda: httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30))
    srv.slot_decoded(3)
    rc = srv.signal_and_wait(signal.SIGINT)
    request.join(10)
    assert rc == 0, srv.log
    r = out["result"]
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["choices"][0]["finish_reason"] == "length"
    assert 3 <= res["usage"]["completion_tokens"] < 2000
    assert "stop = shutdown" in srv.log and "Traceback" not in srv.log
    # -lv 4: the successful request has its line, with its tokens
    line = next(x for x in srv.lines if "POST /v1/chat/completions" in x)
    n_prompt, n_predicted = res["usage"]["prompt_tokens"], res["usage"]["completion_tokens"]
    assert f" 200 | n_prompt = {n_prompt}, n_predicted = {n_predicted} | " in line, line


def test_a_second_signal_exits_at_once(servers: dict[str, Server]) -> None:
    srv = servers["second_signal"]
    # a client that never finishes its request body holds the graceful shutdown open
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.3)  # let the server read the headers: the request is then in flight
        srv.proc.send_signal(signal.SIGTERM)
        srv.wait_line("cleaning up before exit")
        assert srv.proc.poll() is None  # still waiting for the slow client
        rc = srv.signal_and_wait(signal.SIGTERM)
    assert rc == 1 and "terminating immediately" in srv.log, srv.log
    assert "Traceback" not in srv.log


def test_an_exception_in_a_route_is_one_line_and_an_answer() -> None:
    """The access log is the last guard: before the response starts a 500 JSON, inside a stream
    an error event that ends it; one log line each, no traceback."""
    lines: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/stream":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        raise ValueError("boom\nsecond line")

    client = TestClient(AccessLog(app, write=lines.append), raise_server_exceptions=False)
    r = client.get("/plain")
    assert r.status_code == 500
    assert r.json() == {"error": {"code": 500, "message": "ValueError: boom second line", "type": "server_error"}}
    r = client.get("/stream")
    assert r.status_code == 200 and r.text.endswith(
        'data: {"error":{"code":500,"message":"ValueError: boom second line","type":"server_error"}}\n\n'
    )
    assert len(lines) == 2 and all("\n" not in x and "error: ValueError: boom second line" in x for x in lines), lines
    assert " 500 | " in lines[0] and " 200 | " in lines[1]
