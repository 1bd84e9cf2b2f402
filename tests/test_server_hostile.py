"""`ubatch server` against a hostile client (issues 32 and 49: no request can stall the server).

One `ubatch server` subprocess (a tiny model, -to 2, a 4 MiB body limit, a chat template that
would run for minutes if rendering were not bounded) takes each attack while a normal completion
runs beside it and another process polls /health: the attack is refused or bounded within
seconds, the normal request completes within twice its usual time, /health keeps answering, and
the server's RSS stays within 100 MiB of where it started. Issue 49's attacks are JSON-schema
patterns whose matching is ambiguous (nested repetition), through every door a schema has; the
strict numbers (p99, /health within 0.5 s) are scripts/hostile_grammar.py's to measure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

MAX_BODY = 4 << 20  # the server's --max-body-size here
TIMEOUT_S = 2  # the server's -to here: header and body reads
HEALTH_BOUND_S = 2.0  # /health under attack: the goal is 100 ms; this bound holds on a loaded 2-core CI machine, and the stalls it guards against lasted 10-20 s
ATTACK_BOUND_S = 8.0  # every attack is refused or done by then
SLACK_S = 1.0  # scheduling noise added to "twice the usual time" on a loaded 2-core machine; the stalls were 10-20 s
RSS_GROWTH_MIB = 100
LIGHT_BOUND_S = (
    1.0  # a short /tokenize or /v1/models beside hostile preparations: milliseconds, if they never share workers
)
NORMAL = {"prompt": "hello there", "n_predict": 8, "temperature": 0, "ignore_eos": True}

# /health, polled from another process (this one's GIL is busy building attack bodies): it says
# "ready" after its first answer, then polls until its stdin closes, when the attack is over
PROBE = r"""
import sys, threading, time, httpx
url, over, worst, n = sys.argv[1], threading.Event(), 0.0, 0
threading.Thread(target=lambda: (sys.stdin.read(), over.set()), daemon=True).start()
with httpx.Client(timeout=30) as c:
    while True:
        t = time.perf_counter()
        ok = c.get(url + "/health").status_code == 200
        worst, n = max(worst, time.perf_counter() - t if ok else 99.0), n + 1
        if n == 1:
            print("ready", flush=True)
        if over.wait(0.02):
            break
print(worst, n)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    port: int


@contextmanager
def _started(model: Path, *extra: str) -> Iterator[Server]:
    """`ubatch server` as a subprocess (its own RSS, its own event loop) on a free port."""
    port = _free_port()
    cmd = [sys.executable, "-m", "ubatch.cli.main", "server", "-m", str(model), "-np", "2", "-c", "1024"]
    cmd += ["--port", str(port), "-to", str(TIMEOUT_S), "--max-body-size", str(MAX_BODY), "--log-disable", "-t", "1"]
    proc = subprocess.Popen([*cmd, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        assert proc.poll() is None and time.time() < deadline, "the server did not start"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    try:
        yield Server(url, proc, port)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The one server every attack meets; its chat template is HOSTILE_TEMPLATE (below), which only
    chat requests render."""
    tmpl = tmp_path_factory.mktemp("hostile") / "hostile.jinja"
    tmpl.write_text(HOSTILE_TEMPLATE)
    with _started(tiny_gemma, "--chat-template-file", str(tmpl)) as srv:
        yield srv


def _normal(url: str) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/completion", json=NORMAL, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 8, r.text
    return time.perf_counter() - t


@pytest.fixture(scope="module")
def usual(server: Server) -> float:
    """The normal request's usual time: the worst of a few runs on the idle server."""
    _normal(server.url)  # warm
    return max(_normal(server.url) for _ in range(3))


def _under_attack(server: Server, usual: float, attack: Callable[[], Any], bound: float = ATTACK_BOUND_S) -> Any:
    """Run `attack` while a normal request and a /health poller run beside it; check the bounds
    and return what the attack returned."""
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE, server.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert probe.stdout is not None and probe.stdout.readline() == "ready\n"  # polling from before the attack
    out: list[Any] = []
    t0 = time.perf_counter()
    th = threading.Thread(target=lambda: out.append(attack()), daemon=True)
    th.start()
    time.sleep(0.05)
    normal = _normal(server.url)
    th.join(bound)
    assert not th.is_alive(), f"the attack still runs after {bound} s"
    took = time.perf_counter() - t0
    worst, n = probe.communicate(timeout=30)[0].split()  # closes its stdin: the attack is over
    assert normal <= 2 * usual + SLACK_S, f"normal request {normal:.3f} s under attack, usually {usual:.3f} s"
    assert float(worst) <= HEALTH_BOUND_S, f"/health took {float(worst):.3f} s at worst ({n} polls)"
    assert took <= bound
    return out[0]


def _post(url: str, path: str, body: bytes, **kw: Any) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30, **kw)


def _error(r: httpx.Response, code: int) -> str:
    assert r.status_code == code, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == code and isinstance(err["type"], str)
    return str(err["message"])


def test_oversized_body_is_413_before_it_is_read(server: Server, usual: float) -> None:
    rss0 = _rss_mib(server.proc.pid)

    def declared() -> str:  # a Content-Length of 100 MB, then silence: answered without the body
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")
            got = b""
            while not got.endswith(b"}}") and (more := s.recv(4096)):
                got += more
            return got.decode("latin-1")

    head = _under_attack(server, usual, declared)
    assert head.startswith("HTTP/1.1 413") and "--max-body-size" in head

    def chunked() -> httpx.Response:  # no Content-Length: cut once the chunks pass the limit
        chunk = b" " * (1 << 20)
        return httpx.post(server.url + "/completion", content=iter([chunk] * 64), timeout=30)

    r = _under_attack(server, usual, chunked)
    assert "--max-body-size" in _error(r, 413)
    assert _rss_mib(server.proc.pid) - rss0 < RSS_GROWTH_MIB


def test_deep_json_is_400_quickly(server: Server, usual: float) -> None:
    r = _under_attack(server, usual, lambda: _post(server.url, "/completion", b"[" * 100_000))
    assert "--max-json-depth" in _error(r, 400)
    body = {"prompt": "hi", "x": json.loads("[" * 200 + "]" * 200)}  # within the limit: fine
    assert _post(server.url, "/completion", json.dumps({**body, "n_predict": 1}).encode()).status_code == 200


def test_heavy_tokenize_does_not_stall_others(server: Server, usual: float) -> None:
    data = json.dumps({"content": "hello world, " * 250_000}).encode()  # 3.25 MB
    r = _under_attack(server, usual, lambda: _post(server.url, "/tokenize", data))
    assert r.status_code == 200 and len(r.json()["tokens"]) > 250_000


def test_many_logit_bias_keys(server: Server, usual: float) -> None:
    bias = {f"w{i}": -1 for i in range(20_000)}
    data = json.dumps({"prompt": "hi", "n_predict": 2, "logit_bias": bias}).encode()
    r = _under_attack(server, usual, lambda: _post(server.url, "/completion", data))
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize(
    "body",
    [
        {"grammar": 'root ::= r{0,2000}\nr ::= "a"{0,2000}'},
        {"json_schema": {"type": "string", "pattern": "^(a{0,2000}){0,2000}$"}},
        {"grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000},
    ],
    ids=["nested-repetition", "schema-pattern", "deep-parentheses"],
)
def test_hostile_grammar_is_refused_or_bounded(server: Server, usual: float, body: dict[str, Any]) -> None:
    data = json.dumps({"prompt": "hi", "n_predict": 2, **body}).encode()
    r = _under_attack(server, usual, lambda: _post(server.url, "/completion", data))
    if "(((" in data.decode():  # 5000 parentheses: a 400 (too deep) or, if it compiles, a completion
        assert r.status_code in (200, 400), r.text[:300]
    else:
        _error(r, 400)


def test_slow_headers_are_cut_off(server: Server, usual: float) -> None:
    def slowloris() -> list[bytes]:
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S + 5) for _ in range(50)]
        for i, s in enumerate(socks):  # half send nothing, half an unfinished request head
            if i % 2:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            return [s.recv(1024) for s in socks]  # b"": the server closed it
        finally:
            for s in socks:
                s.close()

    t = time.perf_counter()
    assert _under_attack(server, usual, slowloris) == [b""] * 50
    assert time.perf_counter() - t < TIMEOUT_S + 3


def test_trailing_slash_is_404(server: Server) -> None:
    for path in ("/health/", "/v1/health/", "/completion/"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["message"] == "File Not Found", path
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# a chat template that would run for minutes, or build gigabytes, if rendering were not bounded:
# which of the three the message's text picks
HOSTILE_TEMPLATE = (
    "{% set m = messages[0].content %}"
    "{% if m == 'loops' %}{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
    "{% elif m == 'bomb' %}{{ 'A' * 4000000000 }}"
    "{% elif m == 'indent' %}{{ messages | tojson(indent=2000000000) }}{% else %}{{ m }}{% endif %}"
)


def test_hostile_chat_template_fails_the_request_not_the_server(server: Server, usual: float) -> None:
    """The template the server renders for chat requests is bounded: /apply-template and a chat
    request fail in one JSON error naming the template, while a plain completion and /health go on."""
    rss = _rss_mib(server.proc.pid)
    for which in ("loops", "bomb", "indent"):
        chat = {"messages": [{"role": "user", "content": which}]}

        def attack(chat: dict[str, Any] = chat) -> list[httpx.Response]:
            return [
                httpx.post(server.url + "/apply-template", json=chat, timeout=60),
                httpx.post(server.url + "/v1/chat/completions", json={**chat, "max_tokens": 4}, timeout=60),
            ]

        for r in _under_attack(server, usual, attack):
            assert r.status_code in (400, 500), (which, r.text[:300])
            assert "chat template" in r.json()["error"]["message"], which
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert _rss_mib(server.proc.pid) - rss < RSS_GROWTH_MIB


# -- issue 49: grammar work bounded as it goes ---------------------------------------------------


def _nested(n: int, ch: str = "a") -> str:
    """Three nested bounded repetitions: exactly n**3 elements (1,000,000 at n = 100, within the
    static limit), and each `ch` can be in up to n**3 places. The server remembers a refused
    pattern: each test spells its own with another `ch`."""
    return f"^(({ch}{{0,{n}}}){{0,{n}}}){{0,{n}}}$"


VARIANT = "^((ab){0,400}c){0,400}$"  # 320,000 elements, unambiguous: a legitimate pattern


def _carrying(door: str, pattern: str) -> tuple[str, dict[str, Any]]:
    """A request whose schema holds `pattern`: in response_format, json_schema or a tool's parameters."""
    schema = {"type": "string", "pattern": pattern}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if door == "response_format":
        rf = {"type": "json_schema", "json_schema": {"schema": schema}}
        return "/v1/chat/completions", {**chat, "response_format": rf}
    if door == "json_schema":
        return "/completion", {"prompt": "hi", "n_predict": 4, "json_schema": schema}
    params = {"type": "object", "properties": {"s": schema}, "required": ["s"]}
    tool = {"type": "function", "function": {"name": "f", "description": "f", "parameters": params}}
    return "/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}


def _send(url: str, door: str, pattern: str, timeout: float = 30) -> httpx.Response:
    path, body = _carrying(door, pattern)
    return httpx.post(url + path, json=body, timeout=timeout)


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


DOORS = ["response_format", "json_schema", "tool"]


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("n", [20, 40, 60, 100])
def test_a_nested_pattern_is_refused_within_its_budget(server: Server, usual: float, n: int, door: str) -> None:
    """Before: N=40 took 10 s and N=100 minutes and gigabytes (past SIGTERM); inside a tool's
    parameters the pattern was met mid-generation. Now a 400 naming the pattern, from any door,
    before a slot is taken."""
    rss = _rss_mib(server.proc.pid)
    pattern = _nested(n, "abc"[DOORS.index(door)])
    r = _under_attack(server, usual, lambda: _send(server.url, door, pattern))
    msg = _error(r, 400)
    assert "grammar too ambiguous" in msg and pattern in msg, msg
    assert _rss_mib(server.proc.pid) - rss < RSS_GROWTH_MIB


@pytest.mark.parametrize("door", DOORS)
def test_a_long_unambiguous_pattern_is_served(server: Server, usual: float, door: str) -> None:
    """`((ab){0,400}c){0,400}` is big but never ambiguous: it passes, and generating under it
    leaves the normal request beside it alone (it waited 18.9 s)."""
    rss = _rss_mib(server.proc.pid)
    r = _under_attack(server, usual, lambda: _send(server.url, door, VARIANT))
    assert r.status_code == 200, r.text[:300]
    assert _rss_mib(server.proc.pid) - rss < RSS_GROWTH_MIB


def test_many_at_once_leave_the_light_routes_free(server: Server, usual: float) -> None:
    """Four hostile preparations at once took all four request workers: /tokenize waited 46 s.
    Preparation has workers of its own now (and probes take turns): six at once of the costliest
    shape (a nesting after text, each refused at the session's limit, ~0.6 s) queue seconds of
    work, yet a short /tokenize and /v1/models answer at once (on shared workers they waited
    for three refusals), and the normal request finds a preparation worker."""
    waits: list[float] = []
    doors = [*DOORS, *DOORS]

    def attack() -> list[httpx.Response]:
        out: list[httpx.Response] = []
        ths = [
            threading.Thread(target=lambda d=doors[i], c=ch: out.append(_send(server.url, d, _costly(c))))
            for i, ch in enumerate("defgtu")
        ]
        for th in ths:
            th.start()
        time.sleep(0.1)
        for path in ("/tokenize", "/v1/models"):
            t = time.perf_counter()
            if path == "/tokenize":
                r = httpx.post(server.url + path, json={"content": "hello world"}, timeout=30)
            else:
                r = httpx.get(server.url + path, timeout=30)
            waits.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text[:300]
        for th in ths:
            th.join(2 * ATTACK_BOUND_S)
        return out

    answers = _under_attack(server, usual, attack, bound=2 * ATTACK_BOUND_S)  # six budgets in turn
    assert [r.status_code for r in answers] == [400] * 6
    assert max(waits) <= LIGHT_BOUND_S, waits


def _costly(ch: str) -> str:
    """A nesting after 40 characters, small enough to pass the first steps: its check runs to
    the session's whole budget."""
    return f"^x{{40}}(({ch}{{0,12}}){{0,12}}){{0,12}}$"


def test_a_client_that_leaves_stops_the_work(server: Server) -> None:
    """The work went on for minutes after the client disconnected. Now it is cancelled in its
    worker: twelve clients that leave at once would queue some seconds of refusals (probes take
    turns), and the server is idle again at once."""
    for i in range(12):
        with pytest.raises(httpx.TimeoutException):
            _send(server.url, DOORS[i % 3], _nested(100, "hijklmnopqrs"[i]), timeout=0.05)
    time.sleep(0.5)
    cpu = _cpu_s(server.proc.pid)
    time.sleep(2.0)
    assert _cpu_s(server.proc.pid) - cpu < 0.5, "the server still works for clients that left"
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_sigterm_stops_the_server_whatever_its_workers_do(tiny_gemma: Path) -> None:
    """SIGTERM waited for the request worker, which ran for minutes (SIGKILL was needed)."""
    from ubatch.cli.server.run import GRACEFUL_SHUTDOWN_S

    with _started(tiny_gemma) as srv:
        for i, door in enumerate(DOORS + DOORS):
            threading.Thread(
                target=lambda d=door, c="klmnop"[i]: _try_send(srv.url, d, _nested(100, c)), daemon=True
            ).start()
        time.sleep(0.2)
        t = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=GRACEFUL_SHUTDOWN_S + 10) == 0
        assert time.perf_counter() - t < GRACEFUL_SHUTDOWN_S + 2


def _try_send(url: str, door: str, pattern: str) -> None:
    try:
        _send(url, door, pattern)
    except httpx.HTTPError:
        pass  # the server stopped under it
