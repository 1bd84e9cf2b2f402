"""The web pages at the server's root, over HTTP without a browser: the chat page and `/engine`
are served from the package, load nothing from elsewhere, `/engine/events` is a parseable
server-sent event stream that shows two sequences' cells and rows, `--path DIR` serves another
folder and `--no-webui` none; the pages stay public under `--api-key`, the stream does not.
Browser checks are in tests/test_webui_browser.py."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from test_server import Live, start_server_engine

from ubatch.cli.server.app import ServerEngine, ServerOptions, create_app
from ubatch.cli.server.routes.webui import WEBUI_DIR, add_webui_routes, public_pages
from ubatch.engine.batch import Batch
from ubatch.engine.kv.cells import KVCells
from ubatch.engine.serve.snapshot import cell_owners, row_runs

OPTION_FIELDS = {f.name for f in fields(ServerOptions)}


def webui_options(path: Path | None = None, webui: bool = True, **kw: Any) -> ServerOptions:
    """ServerOptions with --path / --no-webui, where state.py has those fields."""
    wanted = {"webui": webui, "webui_path": path}
    return replace(ServerOptions(**kw), **{k: v for k, v in wanted.items() if k in OPTION_FIELDS})


def webui_app(eng: ServerEngine, o: ServerOptions, path: Path | None = None, webui: bool = True) -> FastAPI:
    """The app as `ubatch server` builds it. Until cli/server/app.py registers the pages itself,
    they are added here."""
    app = create_app(eng, o)
    app.state.webui_added_here = webui and not any(getattr(r, "path", "") == "/engine/events" for r in app.routes)
    if app.state.webui_added_here:
        add_webui_routes(app, app.state.server, path)
    return app


@pytest.fixture(scope="module")
def engine(tiny_gemma: Path) -> Iterator[ServerEngine]:
    """-np 2 -c 1024 (one unified cache, 512 cells a slot)."""
    eng = start_server_engine(tiny_gemma, 2, 1024)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def served(engine: ServerEngine) -> Iterator[str]:
    live = Live(webui_app(engine, webui_options()))
    yield live.url
    live.close()


def events(url: str, n: int, headers: dict[str, str] | None = None, query: str = "") -> list[tuple[str, Any]]:
    """The first `n` events of /engine/events, parsed."""
    out: list[tuple[str, Any]] = []
    with httpx.stream("GET", url + "/engine/events" + query, headers=headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = "message"
        for line in r.iter_lines():
            if line.startswith("event: "):
                ev = line[7:]
            elif line.startswith("data: "):
                out.append((ev, json.loads(line[6:])))
                if len(out) >= n:
                    break
    return out


# -- the files --------------------------------------------------------------------------------


EXTERNAL = re.compile(r"""(?:https?:)?//[\w.-]+\.[a-z]{2,}|@import|\burl\(\s*['"]?(?!data:)""", re.I)


def generate_in_both_slots(url: str, body: dict[str, Any]) -> list[threading.Thread]:
    """Two completions, one per slot, running in threads (join them when done watching)."""
    threads = [
        threading.Thread(
            target=httpx.post, args=(url + "/completion",), kwargs={"json": {**body, "id_slot": i}, "timeout": 60}
        )
        for i in (0, 1)
    ]
    for t in threads:
        t.start()
    return threads


def test_bundled_files_load_nothing_from_elsewhere() -> None:
    """No CDN, no font, no absolute URL in anything the pages load (the Markdown renderer's
    regex for links in answers names the scheme only)."""
    names = sorted(p.name for p in WEBUI_DIR.iterdir())
    assert {"index.html", "engine.html", "style.css", "common.js", "chat.js", "engine.js", "markdown.js"} <= set(names)
    for name in names:
        text = (WEBUI_DIR / name).read_text()
        hits = [m.group(0) for m in EXTERNAL.finditer(text)]
        assert not hits, f"{name} refers elsewhere: {hits}"
        for src in re.findall(r"""(?:src|href)="([^"]+)""", text):
            assert not src.startswith(("/", "http", "//")), f"{name}: {src} is not relative (breaks --api-prefix)"


def test_pages_served_with_their_types(served: str) -> None:
    for path, marker in [("/", "ubatch chat"), ("/index.html", "ubatch chat"), ("/engine", "ubatch engine")]:
        r = httpx.get(served + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
        assert marker in r.text
        assert "default-src 'none'" in r.headers["content-security-policy"]
    assert httpx.get(served + "/webui/chat.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(served + "/webui/style.css").headers["content-type"].startswith("text/css")
    missing = httpx.get(served + "/webui/nope.js")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "File Not Found"
    assert httpx.get(served + "/webui/..%2Fstate.py").status_code == 404
    assert httpx.get(served + "/health").json() == {"status": "ok"}  # the API is untouched


# -- the event stream -------------------------------------------------------------------------


def test_engine_events_parse(served: str) -> None:
    evs = events(served, 3, query="?interval=0.1")
    (kind, hello), rest = evs[0], evs[1:]
    assert kind == "hello" and hello["n_slots"] == 2
    plan = hello["plan"]
    assert plan["weights"] > 0 and plan["compute"] > 0 and plan["outputs"] > 0 and plan["kv"]
    assert all(k == "state" for k, _ in rest)
    s = rest[-1][1]
    assert [x["id"] for x in s["slots"]] == [0, 1] and s["n_queued"] == 0
    names = [c["name"] for c in s["caches"]]
    assert names == ["non-SWA", "SWA"]  # gemma3: the iSWA pair
    for c in s["caches"]:
        for st in c["streams"]:
            assert sum(n for _, n in st["runs"]) == c["size"]
            assert st["n_kv"] % 256 == 0 or st["n_kv"] == c["size"]


def test_engine_events_show_two_sequences(served: str) -> None:
    """While two clients generate, the stream shows both sequences' cells and rows in decodes."""
    body = {"prompt": "hello there, this is a prompt", "n_predict": 16, "temperature": 0, "ignore_eos": True}
    seen_cells: set[int] = set()
    seen_rows: set[int] = set()
    kinds: set[str] = set()
    deadline = time.monotonic() + 30
    with httpx.stream("GET", served + "/engine/events?interval=0.1", timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: hello"  # the observer is on: the prompts' rows will be seen
        threads = generate_in_both_slots(served, body)
        for line in lines:
            if not line.startswith("data: "):
                continue
            s = json.loads(line[6:])
            for c in s.get("caches", []):
                for st in c["streams"]:
                    seen_cells |= {code - 1 for code, _ in st["runs"] if code > 0}
            for d in s.get("decodes", []):
                for ub in d["ubatches"]:
                    seen_rows |= {seq for seq, _, _ in ub["runs"]}
                    kinds |= {k for _, k, _ in ub["runs"]}
            if {0, 1} <= seen_cells and {0, 1} <= seen_rows and {"p", "g"} <= kinds or time.monotonic() > deadline:
                break
        for t in threads:
            t.join()
    assert {0, 1} <= seen_cells and {0, 1} <= seen_rows and {"p", "g"} <= kinds


def test_no_observer_without_a_watcher(engine: ServerEngine, served: str) -> None:
    """Nothing is attached to the engine once the last watcher left."""
    events(served, 2)
    ctx = engine.scheduler.ctx
    for _ in range(50):
        if not ctx.observers:
            break
        threading.Event().wait(0.05)
    assert ctx.observers == []


def test_cell_owners_runs_and_shared_sets() -> None:
    c = KVCells(10, 3)
    c.pos[:6] = [0, 1, 2, 3, 0, 1]
    c.seq[0:2, 0] = c.seq[0:2, 1] = True  # a prefix shared by 0 and 1
    c.seq[2:4, 0] = True
    c.seq[4:6, 2] = True
    runs, sets = cell_owners(c)
    assert runs == [[-1, 2], [1, 2], [3, 2], [0, 4]] and sets == [[0, 1]]


def test_row_runs_by_sequence_and_kind() -> None:
    from ubatch.engine.batch import RowKind, make_ubatch

    b = Batch()
    b.add(5, 10, 0, True, RowKind.GENERATED)
    b.add(6, 11, 0, True, RowKind.DRAFTED)
    b.add(7, 0, 1)
    b.add(8, 1, 1, True)
    import numpy as np

    ub = make_ubatch(b, np.arange(4))
    assert row_runs(b, ub) == ((0, "g", 1), (0, "d", 1), (1, "p", 2))


# -- options ----------------------------------------------------------------------------------


def test_path_serves_another_folder(engine: ServerEngine, tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<!doctype html><title>mine</title>")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "app.js").write_text("console.log(1)")
    live = Live(webui_app(engine, webui_options(tmp_path), tmp_path))
    try:
        assert "mine" in httpx.get(live.url + "/").text
        assert httpx.get(live.url + "/assets/app.js").text == "console.log(1)"
        assert httpx.get(live.url + "/missing.js").status_code == 404
        assert httpx.get(live.url + "/../state.py").status_code == 404
        assert httpx.get(live.url + "/health").json() == {"status": "ok"}  # API routes first
        assert httpx.get(live.url + "/engine").status_code == 200  # ubatch's own page stays
        assert "/" in public_pages(tmp_path)  # llama-server: only `/` of the folder is public
        assert "/assets/app.js" not in public_pages(tmp_path) and "/props" not in public_pages(tmp_path)
    finally:
        live.close()


def test_no_webui(engine: ServerEngine) -> None:
    if "webui" not in OPTION_FIELDS:
        pytest.skip("ServerOptions.webui is not there yet (cli/server/state.py)")
    live = Live(webui_app(engine, webui_options(webui=False), webui=False))
    try:
        for p in ("/", "/engine", "/engine/events", "/webui/chat.js"):
            assert httpx.get(live.url + p).status_code == 404, p
    finally:
        live.close()


def test_api_key_pages_public_stream_not(engine: ServerEngine) -> None:
    app = webui_app(engine, webui_options(api_keys=("sekret",)))
    live = Live(app)
    try:
        assert httpx.get(live.url + "/").status_code == 200
        assert httpx.get(live.url + "/engine").status_code == 200
        assert httpx.get(live.url + "/webui/chat.js").status_code == 200
        assert httpx.get(live.url + "/props").status_code == 401
        r = httpx.get(live.url + "/engine/events")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        evs = events(live.url, 1, headers={"Authorization": "Bearer sekret"})
        assert evs[0][0] == "hello"
    finally:
        live.close()
