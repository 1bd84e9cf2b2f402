"""The web pages of `ubatch server`: the chat page at `/` (llama-server opens with one too) and
ubatch's own `/engine`, which draws the scheduler's work live from `/engine/events`.

The pages are hand-written files inside the package (`cli/server/webui/`): no build step, no
network, every URL relative so that `--api-prefix` and an offline laptop both work. `--path DIR`
serves another folder at `/` as llama-server's flag does; `--no-webui` registers none of this.
The pages themselves are public by their exact names (they ask for the API key and send it as a
Bearer token); `/engine/events` is an API route like `/slots` and needs the key, and so do the
files of a `--path` folder other than `/`, as in llama-server.
"""

from __future__ import annotations

import asyncio
import json
import mimetypes
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import FileResponse, Response, StreamingResponse

from ubatch.cli.server.engine_view import DEFAULT_INTERVAL_S, EngineView, state_json
from ubatch.cli.server.http import api
from ubatch.cli.server.state import ServerState

WEBUI_DIR = Path(__file__).resolve().parent.parent / "webui"
PAGES = {"/": "index.html", "/index.html": "index.html", "/engine": "engine.html"}
ASSETS = "/webui/"  # the bundled pages' scripts and styles
EVENTS = "/engine/events"
# the bundled pages load nothing from anywhere else, and a browser is told so
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".html": "text/html; charset=utf-8",
}


def public_pages(root: Path | None = None) -> frozenset[str]:
    """The paths the Gate lets through without the API key, each by its exact name, as
    llama-server keeps `/` and its embedded page's assets public (the page is what asks for the
    key): the bundled pages and their files. With `--path DIR` only `/` of that folder is public
    (llama-server's rule): its other files need the key like any route."""
    bundled = {f"{ASSETS}{p.name}" for p in WEBUI_DIR.iterdir() if p.is_file()}
    pages = set(PAGES) if root is None else {"/", "/engine"}
    return frozenset(pages | bundled)


def _file_in(root: Path, name: str) -> Path | None:
    """`name` inside `root` as a plain file, never a path that climbs out of it."""
    if not name:
        name = "index.html"
    try:
        base = root.resolve()
        p = (base / name).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    if base != p and base not in p.parents:
        return None
    return p if p.is_file() else None


def _file(root: Path, name: str, csp: bool) -> Response:
    p = _file_in(root, name)
    if p is None:
        raise StarletteHTTPException(404)  # the app answers llama-server's 404 body
    media = TYPES.get(p.suffix) or mimetypes.guess_type(p.name)[0] or "application/octet-stream"
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    if csp:
        headers["Content-Security-Policy"] = CSP
    return FileResponse(p, media_type=media, headers=headers)


def sse(event: str, data: Any) -> bytes:
    """One server-sent event; the JSON has no newline, so one `data:` line carries it."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def add_webui_routes(app: FastAPI, st: ServerState, path: Path | None = None) -> None:
    """The pages and the engine's event stream. Register after every API route: with `--path`,
    the folder's files are served by a catch-all that must not shadow them."""
    views: dict[int, EngineView] = {}  # one per engine (the engine attaches after the app exists)

    def view() -> EngineView:
        loop = st.eng().loop
        v = views.get(id(loop))
        if v is None or v.loop is not loop:
            views.clear()
            v = views[id(loop)] = EngineView(loop, st.handle())
        return v

    @app.get("/engine")
    async def engine_page(request: Request) -> Response:
        return _file(WEBUI_DIR, "engine.html", csp=True)

    @app.get("/webui/{name}")
    async def asset(request: Request, name: str) -> Response:
        return _file(WEBUI_DIR, name, csp=True)

    @app.get(EVENTS)
    @api
    async def engine_events(request: Request) -> Response:
        """text/event-stream: one `hello` (the memory plan, the sizes), then a `state` event per
        interval (default 0.25 s; `?interval=` 0.1 to 5). Costs the engine nothing until a
        client connects and nothing after the last one leaves."""
        try:
            interval = min(5.0, max(0.1, float(request.query_params.get("interval", DEFAULT_INTERVAL_S))))
        except ValueError:
            interval = DEFAULT_INTERVAL_S
        v = view()
        return StreamingResponse(
            _events(v, interval),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    if path is None:

        @app.get("/")
        @app.get("/index.html")
        async def chat_page(request: Request) -> Response:
            return _file(WEBUI_DIR, "index.html", csp=True)

    else:
        root = path

        @app.get("/{name:path}")
        async def static_file(request: Request, name: str) -> Response:
            return _file(root, name, csp=False)  # another UI may load what it likes


async def _events(v: EngineView, interval: float) -> AsyncIterator[bytes]:
    v.connect()
    try:
        yield sse("hello", v.hello())
        first = await asyncio.to_thread(v.loop.snapshot)
        last = first.decodes[-1].id if first.decodes else 0
        while True:
            snap = state_json(await asyncio.to_thread(v.loop.snapshot), last)
            if snap["decodes"]:
                last = snap["decodes"][-1]["id"]
            yield sse("state", snap)
            await asyncio.sleep(interval)
    finally:
        v.disconnect()
