#!/usr/bin/env python3
"""Issue 49's probe of grammar work: hostile JSON-schema patterns against `ubatch server`.

Each case gets a fresh `ubatch server` subprocess (a runaway case must not bill the next one),
first measured idle (a run of normal completions: their p99; /health), then attacked for
`--window` seconds (each attacker sends again as soon as it is answered, the pattern spelled anew
so that no refusal is remembered) while a client runs normal completions back to back and
another polls /health and /tokenize of a
short text (after a legitimate grammar request has built the vocabulary's token table, which
every grammar needs once). The table gives, per case: the attacks' statuses and longest time to answer, the server's RSS
growth at its peak, the normal requests' p99 under attack against the idle p99, and the worst
/health and /tokenize. The nested patterns `^((a{0,N}){0,N}){0,N}$` (N = 20, 40, 60, 100) and
`^((ab){0,400}c){0,400}$` go through `response_format`, `json_schema` and a tool's parameters;
then four at once, a client that leaves after 0.1 s (the server's CPU seconds in the 3 s after),
and SIGTERM in the middle of four (the time to exit).

`--code DIR` runs the server from another checkout's `ubatch/` (the "before" of a change:
`git archive REV ubatch | tar -x -C DIR`). Usage:
  python scripts/hostile_grammar.py [-m MODEL|tiny] [--code DIR] [--cases a,b] [--cap 30]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the cores are shared

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

NORMAL = {"prompt": "hello there", "n_predict": 8, "temperature": 0, "ignore_eos": True}
IDLE_RUNS = 20


def nested(n: int, ch: str = "a") -> str:
    """n**3 elements (within the static limit up to n = 100), each `ch` in up to n**3 places."""
    return f"^(({ch}{{0,{n}}}){{0,{n}}}){{0,{n}}}$"


VARIANT = "^((ab){0,400}c){0,400}$"


def via(route: str, pattern: str) -> tuple[str, dict[str, Any]]:
    """The request that carries `pattern`: in response_format, json_schema or a tool's parameters."""
    schema = {"type": "string", "pattern": pattern}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    if route == "response_format":
        return "/v1/chat/completions", {
            **chat,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        }
    if route == "json_schema":
        return "/completion", {"prompt": "hi", "n_predict": 16, "json_schema": schema}
    params = {"type": "object", "properties": {"s": schema}, "required": ["s"]}
    tool = {"type": "function", "function": {"name": "f", "description": "f", "parameters": params}}
    return "/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}


Maker = Callable[[int], tuple[str, dict[str, Any]]]  # the k-th request an attacker sends
SPELLINGS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def hostile(route: str, n: int, thread: int = 0) -> Maker:
    """The nested pattern at about n, spelled anew each time (another character, n or n - 1..3):
    a server that remembers refused patterns must still do the work for each."""

    def make(k: int) -> tuple[str, dict[str, Any]]:
        i = thread * 1000 + k
        return via(route, nested(n - (i // len(SPELLINGS)) % 4, SPELLINGS[i % len(SPELLINGS)]))

    return make


def same(route: str, pattern: str) -> Maker:
    return lambda k: via(route, pattern)


@dataclass
class Case:
    name: str
    attackers: list[Maker]  # one thread each, sending again until the window closes
    leave_after: float | None = None  # the client hangs up after this many seconds
    sigterm_after: float | None = None  # SIGTERM the server this long after the first send


DOORS = ("response_format", "json_schema", "tool")


def cases() -> list[Case]:
    out = [Case(f"N={n} {r}", [hostile(r, n)]) for n in (20, 40, 60, 100) for r in DOORS]
    out += [Case(f"(ab){{0,400}}c {r}", [same(r, VARIANT)]) for r in DOORS]
    out.append(Case("4 at once N=40", [hostile(r, 40, t) for t, r in enumerate(DOORS + ("tool",))]))
    out.append(Case("client leaves N=100", [hostile("response_format", 100)], leave_after=0.1))
    doors = ["tool", "tool", "json_schema", "response_format"]
    out.append(Case("SIGTERM during 4 N=100", [hostile(d, 100, t) for t, d in enumerate(doors)], sigterm_after=0.3))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def server(model: Path, code: Path | None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    cmd = [sys.executable, "-m", "ubatch.cli.main", "server", "-m", str(model), "-np", "2", "-c", "2048"]
    cmd += ["--port", str(port), "--log-disable", "-t", "1"]
    proc = subprocess.Popen(cmd, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit("the server did not start")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))] if s else float("nan")


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@dataclass
class Row:
    name: str
    status: str = ""
    answer_s: float = 0.0
    rss_mib: float = 0.0
    idle_p99: float = 0.0
    normal_p99: float = 0.0
    normal_n: int = 0
    health_s: float = 0.0
    tokenize_s: float = 0.0
    extra: str = ""
    problems: list[str] = field(default_factory=list)


def run_case(case: Case, model: Path, code: Path | None, cap: float, window: float) -> Row:
    row = Row(case.name)
    with server(model, code) as (url, proc):
        http = httpx.Client(timeout=cap + 30)
        http.post(url + "/completion", json=NORMAL)  # warm, and build what any grammar needs once
        http.post(url + "/completion", json={**NORMAL, "json_schema": {"type": "string", "pattern": "^[a-z]+$"}})
        idle = [_timed(lambda: http.post(url + "/completion", json=NORMAL)) for _ in range(IDLE_RUNS)]
        row.idle_p99 = p99(idle)
        rss0, peak, over = _proc(proc.pid, "VmRSS"), [0.0], threading.Event()
        normal: list[float] = []
        health, tok = [0.0], [0.0]

        def watch() -> None:
            with httpx.Client(timeout=cap + 30) as c:
                while not over.is_set():
                    try:
                        peak[0] = max(peak[0], _proc(proc.pid, "VmRSS"))
                        health[0] = max(health[0], _timed(lambda: c.get(url + "/health")))
                        tok[0] = max(tok[0], _timed(lambda: c.post(url + "/tokenize", json={"content": "hello world"})))
                    except (httpx.HTTPError, OSError):
                        break
                    over.wait(0.05)

        def normals() -> None:
            with httpx.Client(timeout=cap + 30) as c:
                while not over.is_set():
                    try:
                        normal.append(_timed(lambda: c.post(url + "/completion", json=NORMAL)))
                    except (httpx.HTTPError, OSError):
                        break

        answers: list[tuple[int | str, float]] = []
        t0 = time.perf_counter()
        until = t0 + (window if case.sigterm_after is None else 0.0)

        def attack(make: Maker) -> None:
            timeout = case.leave_after if case.leave_after is not None else cap
            k = 0
            while True:
                path, body = make(k)
                t = time.perf_counter()
                try:
                    code_: int | str = http.post(url + path, json=body, timeout=timeout).status_code
                except httpx.TimeoutException:
                    code_ = "left" if case.leave_after is not None else f">{cap:g}s"
                except httpx.HTTPError as e:
                    code_ = type(e).__name__
                answers.append((code_, time.perf_counter() - t))
                k += 1
                if time.perf_counter() >= until or proc.poll() is not None:
                    return

        bg = [threading.Thread(target=watch, daemon=True), threading.Thread(target=normals, daemon=True)]
        for th in bg:
            th.start()
        time.sleep(0.3)
        attackers = [threading.Thread(target=attack, args=(m,), daemon=True) for m in case.attackers]
        t0 = time.perf_counter()
        for th in attackers:
            th.start()
        if case.sigterm_after is not None:
            time.sleep(case.sigterm_after)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=cap)
                row.extra = f"exit {proc.returncode} after {time.perf_counter() - t0 - case.sigterm_after:.1f} s"
            except subprocess.TimeoutExpired:
                row.extra = f"still running {cap:g} s after SIGTERM (killed)"
        for th in attackers:
            th.join(window + cap + 5)
        time.sleep(0.3)
        over.set()
        for th in bg:
            th.join(cap + 30)
        if case.leave_after is not None and proc.poll() is None:  # nothing else runs now: is it idle?
            cpu = _cpu_s(proc.pid)
            time.sleep(3)
            row.extra = f"{_cpu_s(proc.pid) - cpu:.1f} CPU s in the 3 s after the client left"
        counts: dict[str, int] = {}
        for c, _ in answers:
            counts[str(c)] = counts.get(str(c), 0) + 1
        row.status = " ".join(f"{n}x{c}" for c, n in counts.items()) or "no answer"
        row.answer_s = max((t for _, t in answers), default=0.0)
        row.rss_mib = max(peak[0], _proc(proc.pid, "VmRSS") if proc.poll() is None else 0.0) - rss0
        row.normal_p99, row.normal_n = p99(normal), len(normal)
        row.health_s, row.tokenize_s = health[0], tok[0]
        http.close()
    return row


def resolve_model(arg: str | None) -> Path:
    """-m PATH, `tiny` (a random-weight gemma3 from tests/tiny_models.py) or the default model."""
    if arg == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_models import TinySpec, write_tiny_model

        return write_tiny_model(Path(tempfile.mkdtemp(prefix="probe-")) / "tiny-gemma3.gguf", TinySpec())
    if arg:
        return Path(arg)
    from ubatch.engine.model.default_model import default_model_path

    return default_model_path()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default=None, help="GGUF path or 'tiny'; default: the bundled default model")
    p.add_argument("--code", type=Path, default=None, help="run the server from this checkout (the 'before')")
    p.add_argument("--cases", default="", help="comma-separated substrings of the case names to run")
    p.add_argument("--cap", type=float, default=30.0, help="seconds an attack may take before it counts as a runaway")
    p.add_argument("--window", type=float, default=4.0, help="seconds each attacker keeps sending")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    a = p.parse_args(argv)
    model = resolve_model(a.model)
    picked = [c for c in cases() if not a.cases or any(k in c.name for k in a.cases.split(","))]
    print(f"model {model.name}, code {a.code or 'this checkout'}, cap {a.cap:g} s")
    head = f"{'case':28s} {'status':>20s} {'answer':>8s} {'RSS+':>8s} {'p99 idle':>9s} {'p99 att.':>9s} {'/health':>8s} {'/tokenize':>9s}  other"
    print(head)
    rows = []
    for c in picked:
        r = run_case(c, model, a.code, a.cap, a.window)
        rows.append(r)
        print(
            f"{r.name:28s} {r.status:>20s} {r.answer_s:7.2f}s {r.rss_mib:6.0f}Mi {r.idle_p99:8.3f}s "
            f"{r.normal_p99:8.3f}s {r.health_s:7.3f}s {r.tokenize_s:8.3f}s  n={r.normal_n} {r.extra}",
            flush=True,
        )
    if a.json:
        a.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
