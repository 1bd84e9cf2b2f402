"""What llama-server does to every request before routing it: the `Server: llama.cpp` header,
CORS (`--cors-origins`, `--cors-methods`, `--cors-headers`, `--cors-credentials`), the OPTIONS
preflight (answered here, before the loading check and the API key: browsers send no
Authorization header on a preflight) and `--api-prefix` (the routes exist only under it).

CORS as llama-server decides it:
* `--cors-credentials` with origins `*`: the request's Origin is echoed back;
* origins `localhost`: the Origin is echoed only when its host is `localhost`, `127.0.0.1` or
  `::1` (any scheme http/https, any port); another origin gets no Access-Control-Allow-Origin;
* anything else (`*`, or a comma-separated list): sent as given on every answer.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from starlette.types import Message

from ubatch.cli.server.http import error_response
from ubatch.cli.server.state import ServerOptions
from ubatch.engine.errors import EngineError, ErrorKind

LOCALHOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def origin_is_localhost(origin: str) -> bool:
    """True when an Origin header names a loopback host (llama-server's origin_is_localhost)."""
    try:
        u = urlsplit(origin)
        host = u.hostname
        u.port  # noqa: B018  (a malformed port raises here)
    except ValueError:
        return False
    return u.scheme in ("http", "https") and host is not None and host.lower() in LOCALHOST_NAMES


def allow_origin(o: ServerOptions, origin: str) -> str | None:
    """The Access-Control-Allow-Origin value for a request with this Origin ("" when none)."""
    if o.cors_credentials and o.cors_origins == "*":
        return origin
    if o.cors_origins == "localhost":
        return origin if origin and origin_is_localhost(origin) else None
    return o.cors_origins


def _header(scope: dict[str, Any], name: bytes) -> str:
    for k, v in scope["headers"]:
        if k.lower() == name:
            return v.decode("latin-1")
    return ""


class Edge:
    """ASGI middleware: llama-server's pre-routing handler (see the module docstring)."""

    def __init__(self, app: Any, options: ServerOptions) -> None:
        self.app, self.options = app, options
        self.prefix = options.api_prefix.rstrip("/")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        o = self.options
        extra = [(b"server", b"llama.cpp")]
        acao = allow_origin(o, _header(scope, b"origin"))
        if acao is not None:
            extra.append((b"access-control-allow-origin", acao.encode("latin-1", "replace")))
        if scope["method"] == "OPTIONS":
            extra += [
                (b"access-control-allow-credentials", b"true" if o.cors_credentials else b"false"),
                (b"access-control-allow-methods", o.cors_methods.encode("latin-1", "replace")),
                (b"access-control-allow-headers", o.cors_headers.encode("latin-1", "replace")),
                (b"content-type", b"text/html"),
                (b"content-length", b"0"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": extra})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                known = {k.lower() for k, _ in message.get("headers", [])}
                add = [(k, v) for k, v in extra if k not in known]
                message = {**message, "headers": [*message.get("headers", []), *add]}
            await send(message)

        if self.prefix:
            path = scope["path"]
            if path != self.prefix and not path.startswith(self.prefix + "/"):
                await error_response(EngineError(ErrorKind.NOT_FOUND, "File Not Found"))(
                    scope, receive, send_with_headers
                )
                return
            path = path[len(self.prefix) :] or "/"
            scope = {**scope, "path": path, "raw_path": path.encode("utf-8", "replace")}
        await self.app(scope, receive, send_with_headers)
