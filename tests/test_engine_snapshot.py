"""The engine as the HTTP side sees it: snapshots the engine thread takes between two iterations
(engine/serve/snapshot.py), read by `/engine/events`, `/slots` and `/metrics` in tight loops while
8 streams generate. Every snapshot is consistent (the cells that hold a slot's sequence are
exactly the tokens the slot says they hold), every read answers, and none is skipped."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import Live, start_server_engine

from ubatch.cli.server.app import ServerEngine, ServerOptions, create_app
from ubatch.cli.server.routes.webui import add_webui_routes

N_STREAMS = 8


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> Iterator[tuple[str, ServerEngine]]:
    """-np 8 -c 2048 (256 cells a slot, one unified cache: no window, every cell counted)."""
    eng = start_server_engine(tiny_llama, N_STREAMS, 2048)
    app = create_app(eng, ServerOptions(metrics=True, slots=True))
    if not any(getattr(r, "path", "") == "/engine/events" for r in app.routes):
        add_webui_routes(app, app.state.server)
    live = Live(app)
    yield live.url, eng
    live.close()
    eng.stop()


def cells_by_seq(cache: dict[str, Any]) -> dict[int, int]:
    """Sequence id -> the cells of the cache that hold it (alone or shared), from the runs."""
    held: dict[int, int] = {}
    for st in cache["streams"]:
        for code, n in st["runs"]:
            owners = [code - 1] if code > 0 else st["sets"][-code - 1] if code < 0 else []
            for s in owners:
                held[s] = held.get(s, 0) + n
    return held


def generate(url: str, i: int, out: list[int]) -> None:
    body = {"prompt": f"stream {i}: " + "tell me more " * (i + 1), "n_predict": 128, "temperature": 0}
    with httpx.stream("POST", url + "/completion", json={**body, "stream": True, "ignore_eos": True}, timeout=120) as r:
        out.append(sum(1 for line in r.iter_lines() if line.startswith("data: ")))


def test_snapshots_read_in_tight_loops_while_8_streams_generate_are_consistent(
    served: tuple[str, ServerEngine],
) -> None:
    url, eng = served
    done = threading.Event()
    errors: list[str] = []
    counts = {"slots": 0, "metrics": 0, "state": 0, "direct": 0}

    def poll(path: str, check: Any) -> None:
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                r = c.get(url + path)
                if r.status_code != 200:
                    errors.append(f"{path}: {r.status_code} {r.text[:200]}")
                    return
                check(r)
                counts[path.strip("/")] += 1

    def check_slots(r: httpx.Response) -> None:
        for s in r.json():
            if not 0 <= s["n_cache_tokens"] <= s["n_ctx"]:
                errors.append(f"/slots: {s}")

    def check_metrics(r: httpx.Response) -> None:
        busy = [ln for ln in r.text.splitlines() if ln.startswith("llamacpp:requests_processing ")]
        if len(busy) != 1 or not 0 <= float(busy[0].split()[1]) <= N_STREAMS:
            errors.append(f"/metrics: {busy}")

    def watch_events() -> None:
        last_iteration = -1
        with httpx.stream("GET", url + "/engine/events?interval=0.1", timeout=60) as r:
            for line in r.iter_lines():
                if done.is_set():
                    return
                if not line.startswith("data: ") or '"slots"' not in line:
                    continue
                s = json.loads(line[6:])
                held = cells_by_seq(s["caches"][0])
                for sl in s["slots"]:
                    if held.get(sl["id"], 0) != sl["n_cache"]:
                        errors.append(f"/engine/events: slot {sl['id']} holds {sl['n_cache']} tokens in {held}")
                if s["iteration"] < last_iteration:
                    errors.append("/engine/events: the iteration went back")
                last_iteration = s["iteration"]
                counts["state"] += 1

    def direct() -> None:  # the engine loop's own door, as fast as it answers
        while not done.is_set():
            snap = eng.loop.snapshot()
            cells = snap.caches[0]
            for sl in snap.slots:
                if cells.cells_of(sl.id) != sl.n_cache:
                    errors.append(f"snapshot {snap.iteration}: slot {sl.id} {cells.cells_of(sl.id)} != {sl.n_cache}")
            counts["direct"] += 1

    readers = [
        threading.Thread(target=poll, args=("/slots", check_slots)),
        threading.Thread(target=poll, args=("/metrics", check_metrics)),
        threading.Thread(target=watch_events),
        threading.Thread(target=direct),
    ]
    for t in readers:
        t.start()
    time.sleep(0.3)  # the readers are in their loops before the first prompt arrives
    chunks: list[int] = []
    streams = [threading.Thread(target=generate, args=(url, i, chunks)) for i in range(N_STREAMS)]
    t0 = time.monotonic()
    for t in streams:
        t.start()
    for t in streams:
        t.join()
    elapsed = time.monotonic() - t0
    done.set()
    for t in readers:
        t.join(timeout=30)
    assert not errors, errors[:5]
    assert chunks == [129] * N_STREAMS  # 128 tokens and the final chunk each
    assert counts["slots"] > 10 and counts["metrics"] > 10 and counts["direct"] > 10, counts
    assert counts["state"] >= int(elapsed / 0.1 * 0.5), (counts, elapsed)  # a state event every tick
