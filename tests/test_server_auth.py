"""The API key, route by route, as llama-server keeps it: only `/health`, `/v1/health`, `/` and
the bundled page's own files (each by its exact name) are public; every other route, `/v1/models`
and the files of a `--path` folder included, answers 401 without the key. Paths are taken as
they name themselves: a `.`/`..` or empty segment, however it is spelled or percent-encoded, is
a 404 before any route or file is looked at, so no spelling reaches a file without the key.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.routing import Route
from test_server import Live, start_server_engine

from ubatch.cli.server.app import ServerEngine, ServerOptions, create_app, is_normal
from ubatch.cli.server.routes.webui import WEBUI_DIR

KEY = "k-3f9a"
SECRET = "SECRET=do-not-serve"
BUNDLED = sorted(f"/webui/{p.name}" for p in WEBUI_DIR.iterdir() if p.is_file())


@pytest.fixture(scope="module")
def engine(tiny_gemma: Path) -> Iterator[ServerEngine]:
    eng = start_server_engine(tiny_gemma, 2, 512)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `--path` folder with a page, an asset and a file that must never leave without the key."""
    d = tmp_path_factory.mktemp("site")
    (d / "index.html").write_text("<!doctype html><title>mine</title>")
    (d / "app.js").write_text("console.log(1)")
    (d / ".env").write_text(SECRET)
    (d / "webui").mkdir()
    return d


def raw_get(url: str, target: str, headers: str = "") -> tuple[int, bytes]:
    """GET `target` byte for byte (httpx would normalise dot segments before sending)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{headers}\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def concrete(path: str) -> str:
    """A route's path with its parameters filled in (`/slots/{id_slot}` -> `/slots/0`)."""
    return re.sub(r"\{[^}]+\}", "0", path)


def test_every_route_needs_the_key_but_health_and_the_page(engine: ServerEngine) -> None:
    app = create_app(engine, ServerOptions(api_keys=(KEY,), slot_save_path=None))
    live = Live(app)
    public = {"/health", "/v1/health", "/", "/index.html", "/engine", *BUNDLED}
    try:
        checked = 0
        for r in app.routes:
            if not isinstance(r, Route) or r.methods is None:
                continue
            for method in sorted(r.methods - {"HEAD"}):
                path = concrete(r.path)
                paths = BUNDLED if path == "/webui/0" else [path]
                for p in paths:
                    got = httpx.request(method, live.url + p, timeout=30).status_code
                    checked += 1
                    if p in public and method == "GET":
                        assert got != 401, (method, p)
                    else:
                        assert got == 401, (method, p, got)
        assert checked > 40  # every family of routes was there to check
        for p in ("/v1/models", "/models", "/api/tags", "/props", "/slots", "/metrics", "/engine/events"):
            assert httpx.get(live.url + p, timeout=30).status_code == 401, p
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(live.url + "/v1/models", headers=auth).status_code == 200
        assert httpx.get(live.url + "/v1/models", headers={"X-Api-Key": KEY}).status_code == 200
    finally:
        live.close()


TRAVERSALS = [
    "/webui/../.env",
    "/webui/%2e%2e/.env",
    "/webui/%2E%2E/.env",
    "/webui/.%2e/.env",
    "/webui/%2e./.env",
    "/webui/..%2f.env",
    "/webui%2f..%2f.env",
    "/webui/..%5c.env",
    "/index.html/../.env",
    "/./.env",
    "/%2e/.env",
    "//.env",
    "/webui//../.env",
    "/engine/../.env",
    "/health/../.env",
]


def test_no_spelling_of_a_path_reaches_a_file_without_the_key(engine: ServerEngine, site: Path) -> None:
    live = Live(create_app(engine, ServerOptions(api_keys=(KEY,), webui_path=site)))
    try:
        assert raw_get(live.url, "/")[0] == 200  # the folder's page: public, as llama-server's `/`
        assert raw_get(live.url, "/health")[0] == 200
        for p in ("/.env", "/app.js", "/index.html"):  # its other files need the key, as in llama-server
            status, body = raw_get(live.url, p)
            assert status == 401 and SECRET.encode() not in body, p
        assert raw_get(live.url, "/.env", f"Authorization: Bearer {KEY}\r\n") == (200, SECRET.encode())
        assert raw_get(live.url, "/webui/chat.js")[0] == 200  # the bundled page's files stay public
        for p in TRAVERSALS:
            for headers in ("", f"Authorization: Bearer {KEY}\r\n"):
                status, body = raw_get(live.url, p, headers)
                assert status in (400, 404) and SECRET.encode() not in body, (p, headers, status, body[:200])
    finally:
        live.close()


def test_the_bundled_pages_alone_are_public_without_path(engine: ServerEngine) -> None:
    live = Live(create_app(engine, ServerOptions(api_keys=(KEY,))))
    try:
        for p in ("/", "/index.html", "/engine", *BUNDLED):
            assert raw_get(live.url, p)[0] == 200, p
        for p in ("/webui/missing.js", "/webui/", "/webui/../webui/chat.js", "/favicon.ico"):
            assert raw_get(live.url, p)[0] in (401, 404), p
    finally:
        live.close()


def test_normal_paths() -> None:
    assert is_normal("/") and is_normal("/v1/chat/completions") and is_normal("/slots/0")
    assert is_normal("/a/")  # a trailing slash is a name of its own (llama-server answers it 404)
    for p in ("/..", "/a/../b", "/./a", "/a//b", "//", "/a/.", "a", "/a\\..\\b", "/a\0"):
        assert not is_normal(p), p


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--api-key", " "], "--api-key: holds no key"),
        (["--api-key", " , ,"], "--api-key: holds no key"),
        (["--api-key-file", "KEYS"], "holds no key (every line is empty or a # comment)"),
    ],
)
def test_a_key_flag_holding_no_key_is_refused_at_start(flags: list[str], says: str, tmp_path: Path) -> None:
    """`--api-key " "` used to turn authentication off without a word."""
    (tmp_path / "keys").write_text("# the keys\n\n   \n")
    args = [str(tmp_path / "keys") if f == "KEYS" else f for f in flags]
    r = subprocess.run(
        [sys.executable, "-m", "ubatch", "server", "--port", "0", *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
