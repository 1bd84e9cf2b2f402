"""What llama-server does to every request before routing it: the `Server: llama.cpp` header,
CORS (`--cors-origins`, `--cors-methods`, `--cors-headers`, `--cors-credentials`), the OPTIONS
preflight (answered here, before the loading check and the API key: browsers send no
Authorization header on a preflight) and `--api-prefix` (the routes exist only under it).

CORS as llama-server decides it:
* `--cors-credentials` with origins `*`: the request's Origin is echoed back;
* origins `localhost`: the Origin is echoed only when its host is `localhost`, `127.0.0.1` or
  `::1` (any scheme http/https, any port); another origin gets no Access-Control-Allow-Origin;
* anything else (`*`, or a comma-separated list): sent as given on every answer (llama-server
  does not split a list, nor match the Origin against it).
The preflight adds Access-Control-Allow-Credentials, -Methods and -Headers. A value that is not
a valid header field (a trailing space, a control character) is left out, as cpp-httplib's
set_header leaves it out. JSON answers say `application/json; charset=utf-8`, llama-server's
content type for them. The names leave in llama-server's case (cli/server/protocol.py).
"""

from __future__ import annotations

import re
from typing import Any

from starlette.types import Message

from ubatch.cli.server.http import error_response
from ubatch.cli.server.state import ServerOptions
from ubatch.engine.errors import EngineError, ErrorKind

JSON_UTF8 = b"application/json; charset=utf-8"  # llama-server's content type for every JSON answer
_PLAIN_JSON = (b"content-type", b"application/json")  # Starlette's JSONResponse
LOCALHOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_INT32 = range(-(2**31), 2**31)
_STOI = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


def _url_host(url: str) -> str | None:
    """The host of a URL as llama.cpp's common_http_parse_url splits it, None where it throws:
    scheme exactly http or https, user info cut at the first '@', a bracketed IPv6 literal, and a
    port std::stoi reads (leading digits, within int)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https"):
        return None
    rest = rest.partition("@")[2] if "@" in rest else rest
    host = rest.partition("/")[0]
    port = ""
    if host.startswith("["):
        close = host.find("]")
        if close < 0:
            return None
        after = host[close + 1 :]
        port = after[1:] if after.startswith(":") else ""
        host = host[1:close]
    elif ":" in host:
        host, _, port = host.partition(":")
    if port:
        m = _STOI.match(port)
        if m is None or int(m.group()) not in _INT32:
            return None
    return host


def origin_is_localhost(origin: str) -> bool:
    """True when an Origin header names a loopback host (llama-server's origin_is_localhost:
    the host compared as written, so `http://LOCALHOST` is not one)."""
    return _url_host(origin) in LOCALHOST_NAMES


def allow_origin(o: ServerOptions, origin: str) -> str | None:
    """The Access-Control-Allow-Origin value for a request with this Origin ("" when none)."""
    if o.cors_credentials and o.cors_origins == "*":
        return origin
    if o.cors_origins == "localhost":
        return origin if origin and origin_is_localhost(origin) else None
    return o.cors_origins


def is_field_value(v: bytes) -> bool:
    """cpp-httplib's is_field_value: empty, or visible characters (and obs-text) with spaces or
    tabs only between them."""
    ok = all(0x21 <= c <= 0x7E or c >= 0x80 or c in (0x20, 0x09) for c in v)
    return ok and (not v or (v[0] not in (0x20, 0x09) and v[-1] not in (0x20, 0x09)))


def _argv(s: str) -> bytes:
    """A flag's value as the bytes its command line gave (Python decodes argv with
    surrogateescape)."""
    return s.encode("utf-8", "surrogateescape")


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
        origin = _header(scope, b"origin")
        acao = allow_origin(o, origin)
        if acao is not None:  # the request's own bytes when echoed; a flag's as argv gave them
            extra.append((b"access-control-allow-origin", acao.encode("latin-1") if acao == origin else _argv(acao)))
        if scope["method"] == "OPTIONS":
            extra += [
                (b"access-control-allow-credentials", b"true" if o.cors_credentials else b"false"),
                (b"access-control-allow-methods", _argv(o.cors_methods)),
                (b"access-control-allow-headers", _argv(o.cors_headers)),
                (b"content-type", b"text/html"),
                (b"content-length", b"0"),
            ]
            extra = [(k, v) for k, v in extra if is_field_value(v)]
            await send({"type": "http.response.start", "status": 200, "headers": extra})
            await send({"type": "http.response.body", "body": b""})
            return
        extra = [(k, v) for k, v in extra if is_field_value(v)]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                own = [(k, JSON_UTF8 if (k.lower(), v) == _PLAIN_JSON else v) for k, v in message.get("headers", [])]
                known = {k.lower() for k, _ in own}
                message = {**message, "headers": [*own, *[(k, v) for k, v in extra if k not in known]]}
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
