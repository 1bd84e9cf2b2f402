#!/usr/bin/env python3
"""Shared prefixes: N clients, one common system prompt, distinct questions, on -np 4.

Two parts, both on the same model (default: the bundled Gemma 3 270M):

1. engine: the scheduler driven in-process (no HTTP), with prefix sharing on and off, unified
   cache (-kvu) and per-slot streams: prompt tokens computed, peak KV cells held, cells shared,
   TTFT p50/p99 (from arrival: every client arrives at once) and aggregate t/s.
2. servers: `ubatch server` and llama-server (~/.cache/ubatch-yardstick/build/bin/llama-server)
   with the same flags, the same clients over HTTP (streamed /completion, greedy, ignore_eos):
   prompt tokens computed (sum of timings.prompt_n), TTFT p50/p99, aggregate t/s; peak KV cells
   for ubatch from /metrics (ubatch:kv_cells_used, polled), for llama-server estimated (it does
   not report them: without cross-slot sharing each busy slot holds its whole prompt).

With --index-only, neither: the lookup the prefix index makes for every new prompt, over the
host tier's entries (--entries of --entry-tokens tokens each), as the linear scan it used to be
and as the radix tree it is (engine/serve/radix_tree.py), in three layouts: every entry its own
tokens after BOS, entries sharing 8 system prompts of half their length, and every entry sharing
one prefix of all but 100 tokens (a scan's worst case).

Usage: python scripts/bench_prefix.py [-m MODEL] [--clients 8] [--system 1500] [-n 16] [--skip-servers]
       python scripts/bench_prefix.py --index-only [--entries 1000] [--entry-tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

LLAMA_SERVER = Path.home() / ".cache/ubatch-yardstick/build/bin/llama-server"
WORDS = (
    "river mountain history science careful answer number planet ocean forest language music library "
    "engine theory market city winter summer garden window letter bridge signal memory pattern system "
    "question animal energy simple problem reason travel island weather machine people country market"
).split()


@dataclass
class Row:
    what: str
    computed: int  # prompt tokens computed (not taken from any cache)
    cached: int  # prompt tokens reused
    cells: str  # peak KV cells held
    shared: str  # cells held by more than one sequence at the end
    ttft_p50: float
    ttft_p99: float
    agg_tps: float


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def system_text(n_words: int) -> str:
    rng = np.random.default_rng(0)
    return "You are a helpful assistant. " + " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def questions(n: int) -> list[str]:
    return [
        f"\nQuestion {i}: what is the {WORDS[(7 * i) % len(WORDS)]} of the {WORDS[(3 * i + 1) % len(WORDS)]}?\nAnswer:"
        for i in range(n)
    ]


# -- 1. the engine in-process ---------------------------------------------------------------------
def engine_part(model_path: str | None, args: argparse.Namespace) -> list[Row]:
    from ubatch.engine.context.context import Context
    from ubatch.engine.model.default_model import default_model_path
    from ubatch.engine.model.model import Model
    from ubatch.engine.params import ContextParams
    from ubatch.engine.sampling.chain import SamplerParams
    from ubatch.engine.serve.scheduler import Scheduler
    from ubatch.engine.serve.task import Task, TaskParams

    model = Model.load(Path(model_path) if model_path else default_model_path())
    vocab = model.vocab
    sys_tokens = vocab.tokenize(system_text(args.system * 2), add_special=True)[: args.system]
    qs = [vocab.tokenize(q, add_special=False) for q in questions(args.clients)]
    rows = []
    for unified in (True, False):
        for share in (False, True):
            cp = ContextParams(n_ctx=args.ctx, n_seq_max=args.slots, kv_unified=unified, n_threads=max(args.threads, 0))
            sch = Scheduler(Context(model, cp), args.slots, prefix_sharing=share, cache_ram_mib=8192 if share else 0)
            warm = Task(10_000, [*sys_tokens[:1], *qs[0]], _greedy(TaskParams, SamplerParams, 2), lambda e: None)
            sch.accept(warm)
            while sch.busy:
                sch.step()
            for s in sch.slots:
                s.forget(sch.ctx.memory)
            sch.host.clear()
            clock = Clock()
            first, done = clock.first, clock.done
            tasks = [
                Task(i, [*sys_tokens, *q], _greedy(TaskParams, SamplerParams, args.n_predict, stream=True), clock)
                for i, q in enumerate(qs)
            ]
            computed0 = sch.stats.total.n_prompt_tokens
            t0 = time.perf_counter()
            for t in tasks:
                sch.accept(t)
            peak = 0
            while sch.busy:
                sch.step()
                peak = max(peak, sch.ctx.memory.used)
            wall = time.perf_counter() - t0
            ttft = [1e3 * (first[t.id] - t0) for t in tasks]
            n_gen = sum(f.n_decoded for f in done.values())
            rows.append(
                Row(
                    f"ubatch engine {'-kvu' if unified else 'streams'} sharing {'on' if share else 'off'}",
                    sch.stats.total.n_prompt_tokens - computed0,
                    sum(f.timings.cache_n for f in done.values()),
                    str(peak),
                    str(sch.n_cells_shared),
                    pct(ttft, 50),
                    pct(ttft, 99),
                    n_gen / wall,
                )
            )
            print(_fmt(rows[-1]), flush=True)
    return rows


class Clock:
    """A task sink that notes when each task's first token came, and its final event."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.done: dict[int, Any] = {}

    def __call__(self, ev: Any) -> None:
        from ubatch.engine.serve.task import Final, Partial

        if isinstance(ev, Partial | Final):
            self.first.setdefault(ev.task.id, time.perf_counter())
        if isinstance(ev, Final):
            self.done[ev.task.id] = ev


def _greedy(task_params: Any, sampler_params: Any, n: int, stream: bool = False) -> Any:
    return task_params(n_predict=n, ignore_eos=True, stream=stream, sampling=sampler_params(temp=0.0))


# -- the index alone ------------------------------------------------------------------------------
def scan_longest(entries: list[list[int]], prompt: list[int]) -> tuple[int, int]:
    """The lookup the radix tree replaced: every entry compared with the prompt while they agree."""
    from ubatch.engine.batch import common_prefix

    best, n_best = -1, 0
    for i, e in enumerate(entries):
        if e and prompt and e[0] == prompt[0]:
            n = common_prefix(e, prompt)
            if n > n_best:
                best, n_best = i, n
    return best, n_best


def index_part(args: argparse.Namespace) -> None:
    from ubatch.engine.serve.radix_tree import RadixTree

    rng = np.random.default_rng(0)
    n, size = args.entries, args.entry_tokens

    def tail(k: int) -> list[int]:
        return rng.integers(3, 32000, k).tolist()

    systems = [tail(size // 2) for _ in range(8)]
    common = tail(size - 100)
    layouts = {
        "distinct": [[1, *tail(size - 1)] for _ in range(n)],
        "8 system prompts": [[1, *systems[i % 8], *tail(size - 1 - size // 2)] for i in range(n)],
        "one shared prefix": [[1, *common[: size - 101], *tail(100)] for _ in range(n)],
    }
    print(f"{n} host entries of {size} tokens; each lookup a prompt of {size} tokens sharing 3/4 of one entry")
    print(f"{'layout':<20} {'tree build ms':>13} {'scan us':>10} {'tree us':>10} {'speed-up':>9}")
    for name, entries in layouts.items():
        t0 = time.perf_counter()
        tree: RadixTree[int] = RadixTree()
        for i, e in enumerate(entries):
            tree.insert(i, e)
        build_ms = (time.perf_counter() - t0) * 1e3
        prompts = []
        for _ in range(args.lookups):
            e = entries[int(rng.integers(n))]
            prompts.append(e[: size * 3 // 4] + tail(size - size * 3 // 4))
        for p in prompts:  # both find the same length
            assert tree.longest(p)[1] == scan_longest(entries, p)[1]
        t0 = time.perf_counter()
        for p in prompts:
            scan_longest(entries, p)
        scan_us = (time.perf_counter() - t0) / len(prompts) * 1e6
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            for p in prompts:
                tree.longest(p)
        tree_us = (time.perf_counter() - t0) / (reps * len(prompts)) * 1e6
        print(f"{name:<20} {build_ms:>13.1f} {scan_us:>10.0f} {tree_us:>10.1f} {scan_us / tree_us:>8.0f}x", flush=True)


# -- 2. the servers over HTTP ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], url: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            sys.exit(f"{cmd[0]} exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.terminate()
            sys.exit(f"{cmd[0]} did not become ready")
        time.sleep(0.3)


def kv_cells(url: str) -> int:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("ubatch:kv_cells_used "):
            return int(float(line.split()[1]))
    return -1


def poll(url: str, peak: list[int], stop: threading.Event) -> None:
    """Keep the largest ubatch:kv_cells_used seen until `stop`."""
    while not stop.is_set():
        peak[0] = max(peak[0], kv_cells(url))
        time.sleep(0.1)


def one_client(url: str, prompt: list[int], n: int, barrier: threading.Barrier, out: list[Any], i: int) -> None:
    body = {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "cache_prompt": True,
    }
    barrier.wait()
    t0, t_first, count, timings = time.perf_counter(), None, 0, {}
    with httpx.stream("POST", url + "/completion", json=body, timeout=1200) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev.get("content") or ev.get("tokens"):
                    t_first = t_first or time.perf_counter()
                if not ev.get("stop"):
                    count += 1
                else:
                    timings = ev.get("timings", {})
    out[i] = (t0, t_first or time.perf_counter(), time.perf_counter(), timings)


def server_part(model_path: str, args: argparse.Namespace) -> list[Row]:
    rows = []
    servers = [("ubatch", [sys.executable, "-m", "ubatch.cli.main", "server"])]
    if LLAMA_SERVER.exists() and not args.ubatch_only:
        servers.append(("llama-server", [str(LLAMA_SERVER)]))
    for unified in (True, False):
        for name, exe in servers:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            flags = ["-m", model_path, "-np", str(args.slots), "-c", str(args.ctx), "--port", str(port), "--metrics"]
            flags += ["-t", str(args.threads)] if args.threads > 0 else []
            flags += ["-kvu"] if unified else ["-no-kvu"]
            proc = start([*exe, *flags], url)
            try:
                tok = httpx.post(url + "/tokenize", json={"content": system_text(args.system * 2), "add_special": True})
                sys_tokens = tok.json()["tokens"][: args.system]
                qs = [
                    httpx.post(url + "/tokenize", json={"content": q, "add_special": False}).json()["tokens"]
                    for q in questions(args.clients)
                ]
                httpx.post(
                    url + "/completion", json={"prompt": qs[0], "n_predict": 2, "cache_prompt": False}, timeout=600
                )
                out: list[Any] = [None] * args.clients
                barrier = threading.Barrier(args.clients)
                threads = [
                    threading.Thread(target=one_client, args=(url, [*sys_tokens, *q], args.n_predict, barrier, out, i))
                    for i, q in enumerate(qs)
                ]
                peak, stop = [0], threading.Event()
                poller = threading.Thread(target=poll, args=(url, peak, stop)) if name == "ubatch" else None
                for t in threads:
                    t.start()
                if poller:
                    poller.start()
                for t in threads:
                    t.join()
                stop.set()
                if poller:
                    poller.join()
                t0, t1 = min(o[0] for o in out), max(o[2] for o in out)
                computed = sum(o[3].get("prompt_n", 0) for o in out)
                cached = sum(o[3].get("cache_n", 0) for o in out)
                n_gen = sum(o[3].get("predicted_n", 0) for o in out)
                ttft = [1e3 * (o[1] - o[0]) for o in out]
                est = min(args.clients, args.slots) * (len(sys_tokens) + max(map(len, qs)) + args.n_predict)
                cells = str(peak[0]) if name == "ubatch" else f"~{est} est."
                rows.append(
                    Row(
                        f"{name} {'-kvu' if unified else 'streams'}",
                        computed,
                        cached,
                        cells,
                        "",
                        pct(ttft, 50),
                        pct(ttft, 99),
                        n_gen / (t1 - t0),
                    )
                )
                print(_fmt(rows[-1]), flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    return rows


HEAD = f"{'run':<38} {'computed':>8} {'cached':>7} {'peak KV cells':>14} {'shared':>6} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'agg t/s':>8}"


def _fmt(r: Row) -> str:
    return (
        f"{r.what:<38} {r.computed:>8} {r.cached:>7} {r.cells:>14} {r.shared:>6} "
        f"{r.ttft_p50:>11.0f} {r.ttft_p99:>11.0f} {r.agg_tps:>8.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--system", type=int, default=1500, help="system prompt tokens")
    ap.add_argument("-n", "--n-predict", type=int, default=16)
    ap.add_argument("-np", "--slots", type=int, default=4)
    ap.add_argument("-c", "--ctx", type=int, default=8192)
    ap.add_argument("-t", "--threads", type=int, default=-1)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-servers", action="store_true")
    ap.add_argument("--ubatch-only", action="store_true", help="no llama-server")
    ap.add_argument("--index-only", action="store_true", help="time the prefix index's lookup alone")
    ap.add_argument("--entries", type=int, default=1000, help="host entries (--index-only)")
    ap.add_argument("--entry-tokens", type=int, default=2000, help="tokens per host entry (--index-only)")
    ap.add_argument("--lookups", type=int, default=20, help="prompts looked up (--index-only)")
    args = ap.parse_args()
    if args.index_only:
        index_part(args)
        return
    from ubatch.engine.model.default_model import default_model_path

    model_path = args.model or str(default_model_path())
    print(
        f"model {Path(model_path).name}; {args.clients} clients, system prompt {args.system} tokens, "
        f"-n {args.n_predict}, -np {args.slots}, -c {args.ctx}, {os.cpu_count()} CPUs"
    )
    print(HEAD)
    print("-" * len(HEAD))
    if not args.skip_engine:
        engine_part(args.model, args)
    if not args.skip_servers:
        server_part(model_path, args)


if __name__ == "__main__":
    main()
