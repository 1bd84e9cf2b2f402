"""Response heads as llama-server (cpp-httplib) writes them, read from a raw socket: header names
in its case (a client reading them into a case-sensitive map finds `Content-Type`,
`Access-Control-Allow-Origin`...), its JSON content type, and CORS per --cors-origins keyword
as its pre-routing handler decides (tools/server/server-http.cpp), down to how it parses an
Origin (common/http.h common_http_parse_url)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import h11
import pytest
import uvicorn

from ubatch.cli.server.app import create_app
from ubatch.cli.server.middleware import allow_origin, is_field_value, origin_is_localhost
from ubatch.cli.server.protocol import CanonicalCaseConnection, canonical_name
from ubatch.cli.server.run import uvicorn_config
from ubatch.cli.server.state import ServerOptions, ServerState


class Server:
    """`ubatch server`'s uvicorn set-up (its protocol class) on a loopback port, with no model:
    every route but the preflight answers 503 Loading model, through the same edge."""

    def __init__(self, **options: object) -> None:
        app = create_app(state=ServerState(ServerOptions(**options)), log_verbosity=None)  # type: ignore[arg-type]
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, 30))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.01)

    def head(self, method: str, path: str, *headers: str) -> tuple[str, list[tuple[str, str]]]:
        """The status line and the (name, value) pairs exactly as the bytes spell them."""
        lines = [f"{method} {path} HTTP/1.1", "Host: x", "Connection: close", *headers, "", ""]
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as c:
            c.sendall("\r\n".join(lines).encode("latin-1"))
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = c.recv(65536)
                assert chunk, data
                data += chunk
        status, *fields = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        return status, [(k, v) for k, _, v in (f.partition(": ") for f in fields)]

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def serve() -> Iterator[type[Server]]:
    started: list[Server] = []

    class Started(Server):
        def __init__(self, **options: object) -> None:
            super().__init__(**options)
            started.append(self)

    yield Started
    for s in started:
        s.close()


def test_names_leave_in_llama_servers_case(serve: type[Server]) -> None:
    s = serve(cors_origins="*")
    status, fields = s.head("GET", "/health", "Origin: http://web.example")
    assert status == "HTTP/1.1 503 Service Unavailable"
    got = dict(fields)  # the case-sensitive map a harness builds
    assert got["Content-Type"] == "application/json; charset=utf-8"  # llama-server's, not Starlette's
    assert got["Server"] == "llama.cpp"
    assert got["Access-Control-Allow-Origin"] == "*"
    assert int(got["Content-Length"]) > 0
    assert all(w[:1].isupper() for name, _ in fields for w in name.split("-")), fields

    status, fields = s.head("OPTIONS", "/v1/chat/completions", "Origin: http://web.example")
    assert status == "HTTP/1.1 200 OK"
    assert dict(fields) | {"Date": ""} == {
        "Date": "",
        "Server": "llama.cpp",
        "Access-Control-Allow-Origin": "*",
        "Access-Control-Allow-Credentials": "false",
        "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
        "Access-Control-Allow-Headers": "*",
        "Content-Type": "text/html",
        "Content-Length": "0",
        "Connection": "close",
    }


def test_canonical_names() -> None:
    assert canonical_name(b"content-type") == b"Content-Type"
    assert canonical_name(b"access-control-allow-origin") == b"Access-Control-Allow-Origin"
    assert canonical_name(b"process-start-time-unix") == b"Process-Start-Time-Unix"
    assert canonical_name(b"x-accel-buffering") == b"X-Accel-Buffering"
    assert canonical_name(b"etag") == b"ETag" and canonical_name(b"SERVER") == b"Server"


def test_connection_writes_the_names_it_is_given_in_case() -> None:
    """A streamed answer: h11 adds Transfer-Encoding itself, also in that case."""
    conn = CanonicalCaseConnection(h11.SERVER)
    conn.receive_data(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    head = conn.send(
        h11.Response(
            status_code=200,
            headers=[(b"content-type", b"text/event-stream"), (b"x-accel-buffering", b"no"), (b"etag", b'"1"')],
        )
    )
    assert b"\r\nContent-Type: text/event-stream\r\n" in head and b"\r\nX-Accel-Buffering: no\r\n" in head
    assert b"\r\nETag: " in head and b"\r\nTransfer-Encoding: chunked\r\n" in head
    assert head == head.replace(b"content-type", b"")  # no lower-case name left


# -- CORS, per --cors-origins keyword --------------------------------------------------------------


@pytest.mark.parametrize(
    "origin, local",
    [
        ("http://localhost", True),
        ("https://localhost:5173", True),
        ("http://127.0.0.1:8080/path", True),
        ("http://[::1]", True),
        ("http://[::1]:3000", True),
        ("http://user:pw@localhost:1", True),  # user info before '@' is cut
        ("http://localhost:80abc", True),  # std::stoi reads the leading digits
        ("http://LOCALHOST", False),  # the host is compared as written
        ("HTTP://localhost", False),  # the scheme too
        ("ws://localhost", False),
        ("http://localhost:abc", False),  # stoi throws
        ("http://localhost:99999999999", False),  # out of int
        ("http://[::1", False),  # unclosed bracket
        ("http://localhost.evil.com", False),
        ("http://127.0.0.2", False),
        ("http://::1", False),  # unbracketed: host '' before the first ':'
        ("localhost", False),  # no scheme
        ("null", False),
        ("", False),
    ],
)
def test_origin_is_localhost_as_llama_cpp_parses_it(origin: str, local: bool) -> None:
    assert origin_is_localhost(origin) is local


def test_allow_origin_per_keyword() -> None:
    def acao(origins: str, credentials: bool, origin: str) -> str | None:
        return allow_origin(ServerOptions(cors_origins=origins, cors_credentials=credentials), origin)

    assert acao("*", False, "http://a.example") == "*"  # '*' sent as given
    assert acao("*", True, "http://a.example") == "http://a.example"  # with credentials: echoed
    assert acao("*", True, "") == ""  # echoed even when absent (an empty header, as httplib)
    assert acao("localhost", True, "http://localhost:1") == "http://localhost:1"
    assert acao("localhost", False, "http://a.example") is None  # refused: no header
    assert acao("localhost", False, "") is None
    listed = "http://a.example,http://b.example"  # a list is not split nor matched: sent as given
    assert acao(listed, False, "http://c.example") == listed
    assert acao(listed, True, "http://a.example") == listed


def test_cors_on_the_wire(serve: type[Server]) -> None:
    s = serve(cors_origins="localhost", cors_credentials=True, cors_methods="GET, POST", cors_headers="Authorization")
    _, fields = s.head("OPTIONS", "/completion", "Origin: http://localhost:5173")
    got = dict(fields)
    assert got["Access-Control-Allow-Origin"] == "http://localhost:5173"
    assert got["Access-Control-Allow-Credentials"] == "true"
    assert got["Access-Control-Allow-Methods"] == "GET, POST"
    assert got["Access-Control-Allow-Headers"] == "Authorization"
    _, fields = s.head("GET", "/health", "Origin: http://evil.example")
    assert "Access-Control-Allow-Origin" not in dict(fields)
    _, fields = s.head("GET", "/health", "Origin: http://127.0.0.1")
    assert dict(fields)["Access-Control-Allow-Origin"] == "http://127.0.0.1"


def test_a_value_httplib_would_refuse_is_left_out(serve: type[Server]) -> None:
    assert is_field_value(b"") and is_field_value(b"GET, POST") and is_field_value("é".encode())
    assert not is_field_value(b"GET ") and not is_field_value(b" GET") and not is_field_value(b"a\x01b")
    s = serve(cors_origins="*", cors_methods="GET, POST ")  # a trailing space: httplib drops the header
    _, fields = s.head("OPTIONS", "/completion")
    got = dict(fields)
    assert "Access-Control-Allow-Methods" not in got and got["Access-Control-Allow-Headers"] == "*"
