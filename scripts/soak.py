#!/usr/bin/env python3
"""Soak and fault test of `ubatch server`: N clients over M rounds against -np K, on loopback.

The server runs in this process (the app and scheduler `ubatch server` runs) so that the script
can break it from the inside and look into it afterwards:

  - a decode failure is injected by wrapping that server's `Context.decode`: every Nth decode
    runs, then raises once. The scheduler must answer the requests of that batch with an error
    (500 "Compute error") and keep serving; those requests count as "failed by injection";
  - after each round the slots must be idle and the KV cells accounted for: in a full cache each
    sequence holds exactly its slot's cached tokens (in a sliding-window cache at most that
    many), the used cells are the sum of the slots' caches, and no cell belongs to nobody.

Each round every client runs a seeded mix of greedy requests (streaming and not, on /completion,
/v1/completions and /v1/chat/completions), mid-stream hang-ups, client timeouts and bad requests
(malformed JSON, wrong types, unknown fields, too-long prompts). Every distinct greedy request is
first run alone; each concurrent result must equal it. A request that gets neither a response
nor an error (a cut stream, no answer within the safety timeout) is lost.

With `--hostile`, a hostile client runs beside the rounds the whole time (issues 32 and 49):
oversized bodies, JSON nested 100,000 deep, nested-repetition grammars, JSON-schema patterns whose
matching is ambiguous (in json_schema, response_format and a tool's parameters), a long
unambiguous pattern, a multi-megabyte /tokenize and connections that never finish their headers. Each must be refused or answered (a hostile request
without an answer is lost too); the report gives the normal requests' latency to compare with a
run without `--hostile`.

Exit status 1 if a request was lost, a greedy result differed from its solo run, a request got
an answer it should not (a 5xx that was not injected, a bad request accepted) or the slots were
not clean afterwards. Bounded: `--time-limit` stops starting requests, each request has a
timeout. Usage: python scripts/soak.py [-m MODEL|tiny] [--clients 8] [--rounds 3] [-np 2] [-n 24] [--hostile]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the cores are shared

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from bench_server import PROMPTS  # noqa: E402  (the same prompts as the throughput benchmark)

MARK = "soak: injected decode failure"
SAFETY_TIMEOUT = httpx.Timeout(120.0, connect=10.0)  # no answer by then: the request is lost
CLIENT_TIMEOUT = httpx.Timeout(10.0, read=0.3)  # the impatient client of the "timeout" kind
HANGUP_AFTER = 3  # data events a "disconnect" client reads before it hangs up
HOSTILE_TIMEOUT_S = 5  # the soak server's -to: a header-less connection is closed after this
N_SLOW_HEADERS = 20  # connections per slow-header attack


# -- the requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One kind of client request."""

    name: str
    route: str = ""
    stream: bool = False
    greedy: bool = True  # compared with its solo run
    hangup: str = ""  # "disconnect" (mid-stream) or "timeout" (the client's read timeout)
    bad: bool = False
    cache_prompt: bool = True

    def solo(self) -> Kind:
        """The reference: the same route, not streamed, without the prompt cache."""
        return replace(self, name=self.name + "-solo", stream=False, cache_prompt=False)


NATIVE, OAI, CHAT = "/completion", "/v1/completions", "/v1/chat/completions"
KINDS = [
    Kind("native", NATIVE),
    Kind("native-stream", NATIVE, stream=True),
    Kind("oai", OAI),
    Kind("oai-stream", OAI, stream=True),
    Kind("chat", CHAT),
    Kind("chat-stream", CHAT, stream=True),
    Kind("disconnect", NATIVE, stream=True, greedy=False, hangup="disconnect"),
    Kind("disconnect-chat", CHAT, stream=True, greedy=False, hangup="disconnect"),
    Kind("timeout", NATIVE, greedy=False, hangup="timeout"),
    Kind("bad", greedy=False, bad=True),
]
BAD = KINDS[-1]


@dataclass(frozen=True)
class Bad:
    """A bad request and the statuses a correct server answers it with."""

    name: str
    route: str
    body: bytes
    expect: frozenset[int] = frozenset(range(400, 500))


def bad_requests(n_ctx_slot: int) -> list[Bad]:
    def js(x: Any) -> bytes:
        return json.dumps(x).encode()

    long = "hello " * (n_ctx_slot + 16)
    return [
        Bad("malformed JSON", NATIVE, b'{"prompt": "hello", "n_predict": '),
        Bad("not UTF-8", NATIVE, b'{"prompt": "\xff\xfe"}'),
        Bad("body is an array", OAI, b"[1, 2, 3]"),
        Bad("no prompt", NATIVE, js({"n_predict": 2})),
        Bad("n_predict a string", NATIVE, js({"prompt": "hi", "n_predict": "many"})),
        Bad("temperature an array", OAI, js({"prompt": "hi", "max_tokens": 2, "temperature": [1]})),
        Bad("messages a string", CHAT, js({"messages": "hi"})),
        Bad("stop a number", NATIVE, js({"prompt": "hi", "n_predict": 2, "stop": 7})),
        Bad("prompt too long", NATIVE, js({"prompt": long, "n_predict": 2})),
        Bad("message too long", CHAT, js({"messages": [{"role": "user", "content": long}], "max_tokens": 2})),
        Bad("unknown fields", NATIVE, js({"prompt": "hi", "n_predict": 2, "frobnicate": {"x": 1}}), frozenset({200})),
    ]


@dataclass
class Outcome:
    kind: Kind
    index: int  # prompt (or bad request) index
    status: str = "lost"  # served | rejected | injected | abandoned | unexpected | lost
    content: str = ""
    n_tokens: int = -1  # tokens predicted, where the response says
    detail: str = ""
    ms: float = 0.0


def body_of(kind: Kind, prompt: str, n: int) -> dict[str, Any]:
    if kind.route == CHAT:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n}
    elif kind.route == OAI:
        body = {"model": "soak", "prompt": prompt, "max_tokens": n}
    else:
        body = {"prompt": prompt, "n_predict": n}
    body.update(temperature=0, ignore_eos=True, stream=kind.stream)
    if not kind.cache_prompt:
        body["cache_prompt"] = False
    return body


def content_of(route: str, r: dict[str, Any]) -> tuple[str, int]:
    """The generated text and token count of a non-streamed response."""
    if route == NATIVE:
        return r["content"], r["tokens_predicted"]
    c = r["choices"][0]
    return (c["message"]["content"] if route == CHAT else c["text"]), r["usage"]["completion_tokens"]


def judge_error(out: Outcome, code: int, text: str) -> None:
    """An error answer: injected (it carries our marker), rejected (a bad request's 4xx) or unexpected."""
    try:
        err = json.loads(text)["error"]
        msg = f"{err['code']} {err['type']}: {err['message']}"
    except (ValueError, KeyError, TypeError):
        msg = f"{code} (not llama-server's error JSON) {text[:120]!r}"
    out.detail = msg
    if MARK in msg:
        out.status = "injected"
    elif out.kind.bad and 400 <= code < 500:
        out.status = "rejected"
    else:
        out.status = "unexpected"


def run_action(http: httpx.Client, kind: Kind, prompt: str, n: int, bad: list[Bad], index: int = 0) -> Outcome:
    """Send one request of `kind` on the client's connection pool and say what came of it; never raises."""
    out, t0 = Outcome(kind, index), time.perf_counter()
    try:
        if kind.bad:
            b = bad[index % len(bad)]
            r = http.post(b.route, content=b.body, timeout=SAFETY_TIMEOUT)
            if r.status_code < 300:
                out.status = "served" if r.status_code in b.expect else "unexpected"
            else:
                judge_error(out, r.status_code, r.text)
            if out.status != "injected" and (r.status_code not in b.expect or "error JSON" in out.detail):
                out.status = "unexpected"
            out.detail = f"{b.name}: {r.status_code} {out.detail}"
        elif kind.stream:
            _stream(http, kind, body_of(kind, prompt, n * 8 if kind.hangup else n), out)
        else:
            body = body_of(kind, prompt, n * 8 if kind.hangup else n)
            timeout = CLIENT_TIMEOUT if kind.hangup == "timeout" else SAFETY_TIMEOUT
            r = http.post(kind.route, json=body, timeout=timeout)
            if r.status_code != 200:
                judge_error(out, r.status_code, r.text)
            else:
                out.status = "served"
                out.content, out.n_tokens = content_of(kind.route, r.json())
    except httpx.TimeoutException as e:
        if kind.hangup == "timeout":
            out.status = "abandoned"
        else:
            out.detail = f"no answer: {type(e).__name__}"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        out.detail = f"{type(e).__name__}: {e}"
    out.ms = (time.perf_counter() - t0) * 1e3
    return out


def _stream(http: httpx.Client, kind: Kind, body: dict[str, Any], out: Outcome) -> None:
    """Read a server-sent-events stream to its end (or hang up early); a stream that ends
    without its final event or an error event leaves `out` lost."""
    parts: list[str] = []
    n_events = 0
    with http.stream("POST", kind.route, json=body, timeout=SAFETY_TIMEOUT) as r:
        if r.status_code != 200:
            judge_error(out, r.status_code, r.read().decode("utf-8", "replace"))
            return
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.status, out.content = "served", "".join(parts)
                return
            ev = json.loads(line[6:])
            n_events += 1
            if "error" in ev:
                judge_error(out, int(ev["error"].get("code", 500)), line[6:])
                return
            if kind.route == NATIVE:
                parts.append(ev["content"])
                if ev["stop"]:
                    out.status, out.content, out.n_tokens = "served", "".join(parts), ev["tokens_predicted"]
                    return
            elif ev["choices"]:
                c = ev["choices"][0]
                parts.append((c["delta"].get("content") or "") if kind.route == CHAT else c["text"])
            if kind.hangup == "disconnect" and n_events >= HANGUP_AFTER:
                out.status = "abandoned"
                return  # leaving the block closes the connection mid-stream
    out.detail = f"stream ended after {n_events} events without a final event or an error"


# -- the hostile client (--hostile) -------------------------------------------------------------


@dataclass(frozen=True)
class Attack:
    """One hostile request and the statuses a correct server answers it with."""

    name: str
    route: str
    body: bytes
    expect: frozenset[int]


def attacks() -> list[Attack]:
    def js(x: Any) -> bytes:
        return json.dumps(x).encode()

    refused = frozenset({400})
    nested = {"type": "string", "pattern": "^((a{0,100}){0,100}){0,100}$"}  # issue 49: ambiguous
    long = {"type": "string", "pattern": "^((ab){0,400}c){0,400}$"}  # big, unambiguous: served
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"s": nested}}},
    }
    return [
        Attack("nested pattern (json_schema)", NATIVE, js({"prompt": "hi", "json_schema": nested}), refused),
        Attack(
            "nested pattern (response_format)",
            CHAT,
            js({**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": nested}}}),
            refused,
        ),
        Attack("nested pattern (tool)", CHAT, js({**chat, "tools": [tool], "tool_choice": "required"}), refused),
        Attack("long pattern", NATIVE, js({"prompt": "hi", "n_predict": 2, "json_schema": long}), frozenset({200})),
        Attack("deep JSON", NATIVE, b"[" * 100_000, refused),
        Attack(
            "nested grammar", NATIVE, js({"prompt": "hi", "grammar": 'root ::= r{0,2000}\nr ::= "a"{0,2000}'}), refused
        ),
        Attack(
            "nested schema",
            NATIVE,
            js({"prompt": "hi", "json_schema": {"type": "string", "pattern": "^(a{0,2000}){0,2000}$"}}),
            refused,
        ),
        Attack("heavy tokenize", "/tokenize", js({"content": "hello world, " * 200_000}), frozenset({200})),
        Attack(
            "many logit_bias keys",
            NATIVE,
            js({"prompt": "hi", "n_predict": 2, "logit_bias": {f"w{i}": -1 for i in range(20_000)}}),
            frozenset({200}),
        ),
        Attack("oversized body", NATIVE, b"", frozenset({413})),  # a Content-Length of 100 GB
        Attack("slow headers", "", b"", frozenset({0})),  # connections that never finish their headers
    ]


@dataclass
class HostileReport:
    sent: int = 0
    answered: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)


def _oversized(url: str) -> int:
    """A POST declaring a 100 GB body and sending none of it: the status line's code."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=SAFETY_TIMEOUT.read) as s:
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n")
        return int(s.recv(64).split(b" ")[1])


def _slow_headers(url: str) -> int:
    """N_SLOW_HEADERS connections with an unfinished request head: 0 when the server closed
    every one within twice its timeout, else -1."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=2 * HOSTILE_TIMEOUT_S) for _ in range(N_SLOW_HEADERS)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        return 0 if all(s.recv(64) == b"" for s in socks) else -1
    except OSError:
        return -1
    finally:
        for s in socks:
            s.close()


def run_hostile(url: str, stop: threading.Event, rep: HostileReport) -> None:
    """Send the attacks in turn until `stop`; an attack without the expected answer is lost."""
    mix = attacks()
    with httpx.Client(base_url=url) as http:
        i = 0
        while not stop.is_set():
            a = mix[i % len(mix)]
            i += 1
            rep.sent += 1
            try:
                if a.name == "oversized body":
                    code = _oversized(url)
                elif a.name == "slow headers":
                    code = _slow_headers(url)
                else:
                    code = http.post(a.route, content=a.body, timeout=SAFETY_TIMEOUT).status_code
            except (httpx.HTTPError, OSError, ValueError, IndexError) as e:
                rep.lost.append(f"{a.name}: {type(e).__name__}: {e}")
                continue
            if code in a.expect:
                rep.answered[a.name] += 1
            else:
                rep.lost.append(f"{a.name}: answered {code}, expected {sorted(a.expect)}")


# -- the server ---------------------------------------------------------------------------------


class FaultInjector:
    """Stands in for `Context.decode`: while armed, every Nth decode runs and then raises once,
    so the cells of that batch were placed and the scheduler must free them."""

    def __init__(self, decode: Any, every: int) -> None:
        self.decode, self.every = decode, every
        self.armed, self.n_calls, self.n_raised = False, 0, 0

    def __call__(self, batch: Any) -> None:
        self.decode(batch)
        if self.armed and self.every:
            self.n_calls += 1
            if self.n_calls % self.every == 0:
                self.n_raised += 1
                raise RuntimeError(MARK)


class InProcessServer:
    """The model, a context as `ubatch server` builds it (one sequence and one output row per
    slot), the scheduler and the HTTP app under uvicorn on a free loopback port."""

    def __init__(self, path: Path, n_slots: int, n_ctx: int, fail_every: int) -> None:
        from ubatch.cli.server.app import ServerOptions, create_app
        from ubatch.cli.server.run import start_engine
        from ubatch.engine.context.context import Context
        from ubatch.engine.model.model import Model
        from ubatch.engine.params import ContextParams
        from ubatch.engine.serve.scheduler import Scheduler

        self.model_name = path.name
        ctx = Context(Model.load(path), ContextParams(n_ctx=n_ctx, n_seq_max=n_slots, n_outputs_max=n_slots))
        ctx.warmup()
        self.inject = FaultInjector(ctx.decode, fail_every)
        ctx.decode = self.inject  # type: ignore[method-assign]
        self.engine = start_engine(Scheduler(ctx, n_slots))
        self.sch = self.engine.scheduler
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        from ubatch.cli.server.run import uvicorn_config

        app = create_app(self.engine, ServerOptions(metrics=True, timeout=HOSTILE_TIMEOUT_S))
        self.server = uvicorn.Server(uvicorn_config(app, HOSTILE_TIMEOUT_S))  # as `ubatch server -to 5` runs it
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)

    def wait_idle(self, timeout: float = 30.0) -> list[str]:
        """Wait until no slot is busy and nothing is queued, twice in a row (the engine thread
        then sleeps, so its state can be read from here)."""
        deadline, calm = time.time() + timeout, 0
        while calm < 2:
            if time.time() > deadline:
                busy = [s.id for s in self.sch.slots if s.busy]
                n_queued = self.engine.loop.n_deferred
                return [f"not idle {timeout:.0f} s after the round: busy slots {busy}, {n_queued} queued"]
            idle = not any(s.busy for s in self.sch.slots) and self.engine.loop.n_deferred == 0
            calm = calm + 1 if idle else 0
            time.sleep(0.05)
        return []

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.stop()


def kv_problems(sch: Any) -> list[str]:
    """Every KV cell accounted for by a slot's cached tokens (see engine/kv/cache.py)."""
    out = []
    for c in sch.ctx.memory.caches:
        name = c.name or "KV"
        for s in sch.slots:
            cells = c.streams[c.stream_of(s.id)]
            held = cells.seq[:, s.id] & (cells.pos >= 0)
            n, want = int(held.sum()), len(s.cache)
            if (n != want) if c.n_swa <= 0 else (n > want):
                out.append(f"{name} cache: slot {s.id} holds {n} cells for {want} cached tokens")
            top = int(cells.pos[held].max()) if n else -1
            if top != want - 1:
                out.append(f"{name} cache: slot {s.id}'s last cell is at position {top}, its cache ends at {want - 1}")
        orphans = sum(int(((st.pos >= 0) & ~st.seq.any(1)).sum()) for st in c.streams)
        if orphans:
            out.append(f"{name} cache: {orphans} used cells belong to no sequence")
        total = sum(len(s.cache) for s in sch.slots)
        if c.n_swa <= 0 and c.used != total:
            out.append(f"{name} cache: {c.used} used cells, the slots cache {total} tokens")
    return out


def rss_mb() -> float:
    """This process's resident set (the server runs in it), from /proc, after handing freed heap
    back to the OS (gc, then glibc's malloc_trim): what is held, not what the allocator kept."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, where /proc is missing


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Report:
    """What a soak run measured; `ok` is the exit criterion."""

    outcomes: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    lost_detail: list[str] = field(default_factory=list)
    slot_problems: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)  # after the solo runs, then after each round
    n_injected: int = 0  # decodes that raised
    n_cancelled: int = 0  # tasks the server cancelled because their client went away
    n_solo: int = 0
    rounds_done: int = 0
    stopped_early: bool = False
    seconds: float = 0.0
    setup: str = ""
    machine: str = ""  # CPU model, cores and load average: latency depends on what else runs
    hostile: HostileReport | None = None  # --hostile: what the hostile client sent

    @property
    def lost(self) -> int:
        return self.outcomes["lost"] + (len(self.hostile.lost) if self.hostile else 0)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.mismatches or self.unexpected or self.slot_problems)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile; 0 without samples."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def schedule(
    rng: random.Random, n_clients: int, per_client: int, n_prompts: int, n_bad: int, bad_per_client: int, r: int
) -> list[list[tuple[Kind, int]]]:
    """Each client's (kind, prompt or bad-request index) for round r: the kinds in turn (so a
    round has each one when it has enough requests), shuffled by the seed; then each client's
    extra bad requests (cheap: no generation) at random places, every bad request in turn."""
    kinds = [KINDS[i % len(KINDS)] for i in range(n_clients * per_client)]
    rng.shuffle(kinds)
    plan = [(k, rng.randrange(n_bad if k.bad else n_prompts)) for k in kinds]
    out = [plan[c * per_client : (c + 1) * per_client] for c in range(n_clients)]
    for c, acts in enumerate(out):
        for j in range(bad_per_client):
            acts.insert(rng.randrange(len(acts) + 1), (BAD, ((r * n_clients + c) * bad_per_client + j) % n_bad))
    return out


def run(args: argparse.Namespace, log: Any = print) -> Report:
    rep, t_start = Report(), time.perf_counter()
    deadline = t_start + args.time_limit
    srv = InProcessServer(resolve_model(args.model), args.parallel, args.ctx_size, args.fail_every)
    http = httpx.Client(base_url=srv.url)
    try:
        rep.setup = (
            f"{srv.model_name}, -np {args.parallel}, -c {srv.sch.ctx.cparams.n_ctx} (n_ctx_slot {srv.sch.n_ctx_slot})"
        )
        log(f"soak: {rep.setup}, server at {srv.url}")
        prompts, bad = PROMPTS[: args.prompts], bad_requests(srv.sch.n_ctx_slot)
        rng = random.Random(args.seed)
        plans = [
            schedule(rng, args.clients, args.per_client, len(prompts), len(bad), args.bad, r)
            for r in range(args.rounds)
        ]
        # the reference: each distinct greedy request once, alone, without the prompt cache
        solo: dict[tuple[str, int], str] = {}
        for route, i in sorted({(k.route, i) for plan in plans for acts in plan for k, i in acts if k.greedy}):
            ref = run_action(http, Kind("solo", route).solo(), prompts[i], args.n_predict, bad, i)
            if ref.status == "served" and ref.n_tokens == args.n_predict:
                solo[(route, i)] = ref.content
            else:
                rep.unexpected.append(f"solo {route} #{i}: {ref.status} {ref.n_tokens} tokens {ref.detail}")
        rep.n_solo = len(solo)
        rep.rss_mb.append(rss_mb())
        log(
            f"soak: {rep.n_solo} solo greedy runs, RSS {rep.rss_mb[-1]:.1f} MB, at {time.perf_counter() - t_start:.0f} s"
        )
        stop_hostile = threading.Event()
        hostile_thread = None
        if args.hostile:
            rep.hostile = HostileReport()
            hostile_thread = threading.Thread(
                target=run_hostile, args=(srv.url, stop_hostile, rep.hostile), daemon=True
            )
            hostile_thread.start()
        for r, plan in enumerate(plans):
            if time.perf_counter() > deadline:
                rep.stopped_early = True
                break
            outcomes = run_round(srv, plan, prompts, bad, args.n_predict, deadline)
            for c in (i for i, o in enumerate(outcomes) if o is None):
                rep.outcomes["lost"] += 1
                rep.lost_detail.append(f"round {r + 1} client {c}: its thread never finished")
            problems = srv.wait_idle() + kv_problems(srv.sch)
            rep.slot_problems += [f"round {r + 1}: {p}" for p in problems]
            for out in (x for outs in outcomes if outs for x in outs):
                tally(rep, out, solo, args.n_predict, r)
            rep.rss_mb.append(rss_mb())
            rep.rounds_done = r + 1
            n = sum(len(x) for x in outcomes if x)
            ok = "ok" if not problems else "; ".join(problems)
            log(
                f"soak: round {r + 1}: {n} requests, RSS {rep.rss_mb[-1]:.1f} MB, slots {ok}, at {time.perf_counter() - t_start:.0f} s"
            )
        stop_hostile.set()
        if hostile_thread is not None:
            hostile_thread.join(2 * (SAFETY_TIMEOUT.read or 120.0))
            if hostile_thread.is_alive() and rep.hostile is not None:
                rep.hostile.lost.append("the hostile client never finished")
        rep.n_injected, rep.n_cancelled = srv.inject.n_raised, srv.sch.stats.n_cancelled
        after = run_action(http, Kind("after", NATIVE).solo(), prompts[0], args.n_predict, bad, 0)
        if after.status != "served" or after.content != solo.get((NATIVE, 0), after.content):
            rep.unexpected.append(f"after the soak: {after.status} {after.detail}")
    finally:
        http.close()
        srv.close()
    rep.seconds = time.perf_counter() - t_start
    rep.machine = machine()
    return rep


def machine() -> str:
    from ubatch.kernels.cpu.build import cpu_model

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return f"{cpu_model()}, {os.cpu_count()} cores, load average {load} at the end"


def run_round(
    srv: InProcessServer,
    plan: list[list[tuple[Kind, int]]],
    prompts: list[str],
    bad: list[Bad],
    n: int,
    deadline: float,
) -> list[list[Outcome] | None]:
    """All clients at once (a barrier starts them together), the decode fault armed; None for a
    client thread that never finished."""
    results: list[list[Outcome]] = [[] for _ in plan]
    done = [False] * len(plan)
    barrier = threading.Barrier(len(plan))

    def client(c: int) -> None:
        with httpx.Client(base_url=srv.url) as http:  # one client's pool: a hang-up closes its connection
            barrier.wait()
            for kind, i in plan[c]:
                if time.perf_counter() > deadline:
                    break
                results[c].append(run_action(http, kind, prompts[i % len(prompts)], n, bad, i))
        done[c] = True

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(len(plan))]
    srv.inject.armed = True
    for t in threads:
        t.start()
    for t in threads:  # each request has its own timeout; this is the backstop
        t.join(max(0.0, deadline - time.perf_counter()) + 2 * SAFETY_TIMEOUT.read)
    srv.inject.armed = False
    return [results[c] if done[c] else None for c in range(len(plan))]


def tally(rep: Report, out: Outcome, solo: dict[tuple[str, int], str], n: int, r: int) -> None:
    rep.outcomes[out.status] += 1
    rep.by_kind[out.kind.name] += 1
    where = f"round {r + 1} {out.kind.name} #{out.index}"
    if out.status == "served":
        rep.latencies_ms.append(out.ms)
        ref = solo.get((out.kind.route, out.index))
        if out.kind.greedy and ref is not None and (out.content != ref or out.n_tokens not in (-1, n)):
            rep.mismatches.append(f"{where}: {out.content!r} ({out.n_tokens} tokens) != solo {ref!r}")
    elif out.status == "unexpected":
        rep.unexpected.append(f"{where}: {out.detail}")
    elif out.status == "lost":
        rep.lost_detail.append(f"{where}: {out.detail}")


def format_report(rep: Report) -> list[str]:
    o, rss = rep.outcomes, rep.rss_mb
    growth = f"{rss[-1] - rss[1]:+.1f} MB from round 1 to {len(rss) - 1}" if len(rss) > 2 else "n/a (one round)"
    lines = [
        f"setup            {rep.setup}",
        f"machine          {rep.machine}",
        f"requests         {sum(o.values())} in {rep.rounds_done} rounds, {rep.seconds:.1f} s"
        + (" (stopped at --time-limit)" if rep.stopped_early else ""),
        f"  served         {o['served']}",
        f"  rejected 4xx   {o['rejected']} (bad requests)",
        f"  failed by inj. {o['injected']} ({rep.n_injected} decodes raised)",
        f"  hung up        {o['abandoned']} (client disconnects and timeouts; server cancelled {rep.n_cancelled} tasks)",
        f"  unexpected     {len(rep.unexpected)}",
        f"  lost           {rep.outcomes['lost']}",
        "by kind          " + ", ".join(f"{k} {v}" for k, v in sorted(rep.by_kind.items())),
        f"greedy           {rep.n_solo} solo references, {len(rep.mismatches)} mismatches",
        f"latency (served) p50 {percentile(rep.latencies_ms, 50):.0f} ms, p99 {percentile(rep.latencies_ms, 99):.0f} ms",
        "RSS              " + " -> ".join(f"{x:.1f}" for x in rss) + f" MB (after solo, then each round); {growth}",
        "slots after      "
        + ("all idle, KV cells accounted for" if not rep.slot_problems else "; ".join(rep.slot_problems)),
    ]
    if rep.hostile is not None:
        h = rep.hostile
        lines.insert(
            -2,
            f"hostile          {h.sent} sent, {sum(h.answered.values())} refused or bounded as expected, "
            f"{len(h.lost)} lost (" + ", ".join(f"{k} {v}" for k, v in sorted(h.answered.items())) + ")",
        )
    for title, items in (
        ("LOST", rep.lost_detail + (rep.hostile.lost if rep.hostile else [])),
        ("MISMATCH", rep.mismatches),
        ("UNEXPECTED", rep.unexpected),
    ):
        lines += [f"{title}: {x}" for x in items[:20]]
    lines.append("result           " + ("PASS" if rep.ok else "FAIL"))
    return lines


def resolve_model(arg: str | None) -> Path:
    """-m PATH, `tiny` (a random-weight gemma3 from tests/tiny_models.py) or the default model."""
    if arg == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_models import TinySpec, write_tiny_model

        return write_tiny_model(Path(tempfile.mkdtemp(prefix="soak-")) / "tiny-gemma3.gguf", TinySpec())
    if arg:
        return Path(arg)
    from ubatch.engine.model.default_model import default_model_path

    return default_model_path()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Soak and fault test of ubatch server (in-process, loopback).")
    p.add_argument("-m", "--model", default=None, help="GGUF path or 'tiny'; default: the bundled default model")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-client", type=int, default=2, help="requests per client per round")
    p.add_argument("--bad", type=int, default=2, help="extra bad requests per client per round")
    p.add_argument("-np", "--parallel", type=int, default=2)
    p.add_argument("-c", "--ctx-size", type=int, default=1024)
    p.add_argument("-n", "--n-predict", type=int, default=24, help="tokens per greedy request")
    p.add_argument("--prompts", type=int, default=4, help=f"distinct greedy prompts (1..{len(PROMPTS)})")
    p.add_argument("--fail-every", type=int, default=100, help="every Nth decode raises once (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hostile", action="store_true", help="a hostile client beside the rounds (issue 32)")
    p.add_argument("--time-limit", type=float, default=170.0, help="no new request after this many seconds")
    a = p.parse_args(argv)
    for name in ("clients", "rounds", "per_client", "parallel", "ctx_size", "n_predict", "prompts"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.prompts > len(PROMPTS) or a.bad < 0 or a.fail_every < 0 or not a.time_limit > 0:
        p.error(f"--prompts must be at most {len(PROMPTS)}, --bad and --fail-every >= 0, --time-limit > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    rep = run(parse_args(argv))
    for line in format_report(rep):
        print(line)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
