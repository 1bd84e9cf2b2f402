#!/usr/bin/env python3
"""Aggregate generation throughput of `ubatch server` at 1, 2, 4, 8 concurrent streams.

Starts the real server (default model unless -m) with -np = the largest stream count, warms
every batch shape up, then for each concurrency level sends that many streaming /completion
requests at once (greedy, ignore_eos, so every stream generates exactly -n tokens) and reports:

  aggregate t/s   all generated tokens / wall time from the first request to the last token
  per stream      mean of each stream's own tokens / its own duration
  x vs 1          aggregate t/s relative to one stream: what continuous batching buys
  rows/decode     tokens per decode call (server /metrics): the ubatch width
  decodes/s       decode calls per second: stays near the 1-stream rate while rows grow
  weights GB/s    decodes/s x stored weight bytes (each decode reads every matrix once)

Warm-up is kept out of the numbers. Usage: python scripts/bench_server.py [-m MODEL] [-n 32]

--llama-server BIN starts llama-server beside it (same model, -np, -c, -t) and runs each level
on each in turn, printing aggregate t/s, the ratio and TTFT p50 side by side (issue 47's bar:
   python scripts/bench_server.py -n 64 --streams 1,4,8,16 --repeat 2 \
       --llama-server $(../shared/tools/llama-cpp.sh)/llama-server).

Each stream's client is made and connected before the start, so the requests go out as a
burst and TTFT times the server (a fresh httpx client costs 10-40 ms of this process's GIL;
sixteen of them made after the start spread the burst over hundreds of ms). TTFT is from the
request's send to its first token. --llama-server-args passes more flags to llama-server (e.g.
'--no-repack' where its AMX repacking crashes).

--hogs N runs N CPU hogs (`yes > /dev/null`) beside the server(s) through the measured runs (not
the warm-up): issue 47's busy-machine check, e.g. --hogs 2 on two cores.

--watch keeps an `/engine/events` client connected (what the `/engine` page reads) during every
measured run; --watch both measures each level with and without one, interleaved, and prints
both tables and the ratio: what watching the engine costs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

from ubatch.engine.model.default_model import default_model_path

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "The best way to learn Python is",
    "In the year 2050, cities will",
    "A recipe for pancakes:",
    "The theory of relativity says",
    "My favourite animal is the",
    "The history of the printing press",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def one_stream(url: str, prompt: str, n: int, start: threading.Barrier, out: list[Any], i: int) -> None:
    body = {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "cache_prompt": False,
    }
    # the client is made and connected before the start: an httpx Client's set-up (its SSL
    # context) holds the GIL for 10-40 ms, so 16 made after it would spread the "burst" over
    # hundreds of ms, and TTFT would time this process rather than the server
    with httpx.Client(timeout=600) as client:
        client.get(url + "/health")
        start.wait()
        t0, t_first, count = time.perf_counter(), None, 0
        with client.stream("POST", url + "/completion", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if not ev["stop"]:
                        count += 1
                        t_first = t_first or time.perf_counter()
    out[i] = (t0, t_first, time.perf_counter(), count)


class Watcher:
    """An `/engine/events` client, connected until `close`: it reads every event, as the page does."""

    def __init__(self, url: str) -> None:
        self.n_events, self.error = 0, ""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self.error:
            sys.exit(f"--watch: {self.error or 'no answer from /engine/events'}")

    def _run(self, url: str) -> None:
        try:
            with httpx.stream("GET", url + "/engine/events", timeout=60) as r:
                if r.status_code != 200:
                    self.error = f"/engine/events answered {r.status_code} (a server without the web UI?)"
                    self._ready.set()
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        json.loads(line[6:])
                        self.n_events += 1
                        self._ready.set()
                    if self._stop.is_set():
                        return
        except httpx.HTTPError as e:
            self.error = str(e)
            self._ready.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def run_level(url: str, n_streams: int, n_predict: int, watch: bool = False) -> dict[str, float]:
    watcher = Watcher(url) if watch else None
    try:
        return _run_level(url, n_streams, n_predict)
    finally:
        if watcher is not None:
            watcher.close()


def _run_level(url: str, n_streams: int, n_predict: int) -> dict[str, float]:
    out: list[Any] = [None] * n_streams
    start = threading.Barrier(n_streams)
    threads = [
        threading.Thread(target=one_stream, args=(url, PROMPTS[i % len(PROMPTS)], n_predict, start, out, i))
        for i in range(n_streams)
    ]
    m0 = metrics(url)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m1 = metrics(url)
    t0, t1 = min(o[0] for o in out), max(o[2] for o in out)
    tokens = sum(o[3] for o in out)
    n_dec = m1.get("llamacpp:n_decode_total", 0) - m0.get("llamacpp:n_decode_total", 0)
    rows = m1.get("ubatch:decode_rows_total", 0) - m0.get("ubatch:decode_rows_total", 0)  # llama-server: none
    return {
        "streams": n_streams,
        "tokens": tokens,
        "wall_s": t1 - t0,
        "agg_tps": tokens / (t1 - t0),
        "stream_tps": sum(o[3] / (o[2] - o[0]) for o in out) / n_streams,
        "ttft_ms": 1e3 * sum(o[1] - o[0] for o in out) / n_streams,
        "ttft_p50_ms": 1e3 * statistics.median(o[1] - o[0] for o in out),
        "ttft_max_ms": 1e3 * max(o[1] - o[0] for o in out),
        "rows_per_decode": rows / max(n_dec, 1),
        "decodes_per_s": n_dec / (t1 - t0),
    }


def start_server(cmd: list[str], url: str) -> subprocess.Popen[bytes]:
    # its log goes to a file, never an unread pipe (a full pipe would stall the server)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            log.seek(0)
            sys.exit(f"{cmd[0]} exited ({proc.returncode}): {log.read()[-2000:].decode(errors='replace')}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.terminate()
            sys.exit(f"{cmd[0]} did not become ready")
        time.sleep(0.2)


def side_by_side(rivals: list[tuple[str, str]], levels: list[int], n_predict: int, repeat: int, hogs: int) -> None:
    """Each level on each server in turn (the servers alternate, so load elsewhere hits both
    alike), best aggregate of `repeat` runs each; the ratios ubatch / llama-server."""
    best: dict[tuple[str, int], dict[str, float]] = {}
    for _ in range(repeat):
        for n in levels:
            for name, u in rivals:
                r = run_level(u, n, n_predict)
                if (name, n) not in best or r["agg_tps"] > best[name, n]["agg_tps"]:
                    best[name, n] = r
    load = os.getloadavg()
    print(
        f"{n_predict} tokens per stream, greedy, -np {max(levels)}, {os.cpu_count()} CPUs, best of {repeat}, "
        f"servers alternating, {hogs} CPU hogs beside them; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    head = (
        f"{'streams':>7} {'ubatch t/s':>10} {'llama t/s':>9} {'ratio':>5} "
        f"{'ubatch TTFT p50 ms':>18} {'llama TTFT p50 ms':>17}"
    )
    print(head)
    print("-" * len(head))
    for n in levels:
        a, b = best["ubatch", n], best["llama-server", n]
        print(
            f"{n:>7} {a['agg_tps']:>10.1f} {b['agg_tps']:>9.1f} {a['agg_tps'] / b['agg_tps']:>5.2f} "
            f"{a['ttft_p50_ms']:>18.0f} {b['ttft_p50_ms']:>17.0f}"
        )


def measured_peak_gbs() -> float:
    """Memory bandwidth of a large torch copy on this machine (read + write), best of 5."""
    import torch

    a = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    ap.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per stream")
    ap.add_argument("--streams", default="1,2,4,8", help="concurrency levels")
    ap.add_argument("-c", "--ctx-per-slot", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=-1)
    ap.add_argument("--repeat", type=int, default=3, help="sweeps over the levels; the best run of each is reported")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    ap.add_argument(
        "--watch",
        nargs="?",
        const="on",
        default="off",
        choices=["off", "on", "both"],
        help="keep an /engine/events client connected (on), or measure with and without one (both)",
    )
    ap.add_argument(
        "--llama-server",
        metavar="BIN",
        help="also start this llama-server on the same model and flags, and compare level by level",
    )
    ap.add_argument(
        "--llama-server-args",
        default="",
        metavar="ARGS",
        help="more flags for llama-server, one string (e.g. '--no-repack' where its AMX repacking crashes)",
    )
    ap.add_argument(
        "--hogs", type=int, default=0, help="CPU hogs (`yes > /dev/null`) running beside the server(s) while measuring"
    )
    args = ap.parse_args()
    levels = [int(x) for x in args.streams.split(",")]
    n_slots, port = max(levels), free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "ubatch.cli.main",
        "server",
        "--port",
        str(port),
        "-np",
        str(n_slots),
        "-c",
        str(n_slots * args.ctx_per_slot),
        "--metrics",
        "--log-disable",
        "-t",
        str(args.threads),
    ]
    if args.model:
        cmd += ["-m", args.model]
    procs = [start_server(cmd, url)]
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        rivals: list[tuple[str, str]] = [("ubatch", url)]
        if args.llama_server:
            lport = free_port()
            lurl = f"http://127.0.0.1:{lport}"
            lcmd = [
                args.llama_server,
                "-m",
                args.model or default_model_path(),
                "--port",
                str(lport),
                "-np",
                str(n_slots),
                "-c",
                str(n_slots * args.ctx_per_slot),
                "--metrics",  # no --log-disable: some llama-server builds crash with it (its log goes to a file)
                "-t",
                str(args.threads if args.threads > 0 else os.cpu_count()),
            ]
            procs.append(start_server(lcmd + shlex.split(args.llama_server_args), lurl))
            rivals.append(("llama-server", lurl))
        info = httpx.get(url + "/v1/models").json()["data"][0]
        weight_bytes = info["meta"]["size"]  # the CPU backend reads the GGUF tensors as stored
        for _, u in rivals:
            for n in levels:  # warm-up: plan every batch shape once
                run_level(u, n, 4)
        hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.hogs)]
        if args.llama_server:
            side_by_side(rivals, levels, args.n_predict, args.repeat, args.hogs)
            return
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.watch]
        best: dict[tuple[bool, int], dict[str, float]] = {}
        for _ in range(args.repeat):  # interleaved, so a burst of load elsewhere hits every level alike
            for n in levels:
                for w in modes:
                    r = run_level(url, n, args.n_predict, watch=w)
                    if (w, n) not in best or r["agg_tps"] > best[w, n]["agg_tps"]:
                        best[w, n] = r
        tables = [(w, [best[w, n] for n in levels]) for w in modes]
    finally:
        for proc in [*hogs, *procs]:
            proc.terminate()
            proc.wait(timeout=30)
    peak = measured_peak_gbs()
    print(
        f"model: {info['id']} ({info['meta']['n_params'] / 1e6:.0f} M params), -np {n_slots}, "
        f"{args.n_predict} tokens per stream, greedy, {os.cpu_count()} CPUs, best of {args.repeat}, {args.hogs} CPU hogs"
    )
    print(f"measured copy bandwidth: {peak:.1f} GB/s; weights read per decode: {weight_bytes / 1e9:.2f} GB (as stored)")
    for watched, rows in tables:
        if args.watch != "off":
            print(f"\nwith an /engine/events watcher: {'yes' if watched else 'no'}")
        print_table(rows, weight_bytes, peak)
        if args.json:
            for r in rows:
                print(json.dumps({**r, "watched": watched}))
    if len(tables) == 2:
        print(
            "\nwatched / unwatched aggregate t/s: "
            + ", ".join(
                f"{a['streams']} streams {b['agg_tps'] / a['agg_tps']:.3f}" for a, b in zip(tables[0][1], tables[1][1])
            )
        )


def print_table(rows: list[dict[str, float]], weight_bytes: int, peak: float) -> None:
    base = rows[0]["agg_tps"]
    head = (
        f"{'streams':>7} {'tokens':>6} {'wall s':>7} {'aggregate t/s':>13} {'per stream t/s':>14} "
        f"{'x vs 1':>6} {'TTFT ms':>8} {'rows/decode':>11} {'decodes/s':>9} {'weights GB/s':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        gbs = r["decodes_per_s"] * weight_bytes / 1e9
        print(
            f"{r['streams']:>7} {r['tokens']:>6} {r['wall_s']:>7.2f} {r['agg_tps']:>13.2f} "
            f"{r['stream_tps']:>14.2f} {r['agg_tps'] / base:>6.2f} {r['ttft_ms']:>8.0f} "
            f"{r['rows_per_decode']:>11.2f} {r['decodes_per_s']:>9.2f} {gbs:>7.1f} ({100 * gbs / peak:3.0f}%)"
        )


if __name__ == "__main__":
    main()
