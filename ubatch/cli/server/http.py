"""The plumbing between Starlette and the routes of `ubatch server`: reading a JSON body, and
turning an error into llama-server's status code and error JSON.

The engine raises errors by kind (engine/errors.py); this is the one place a kind becomes an
HTTP status and llama-server's error `type`. Every route module, the middleware and the streams
answer errors through it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server import responses as sj
from ubatch.cli.server.defaults import DEFAULT_MAX_JSON_DEPTH
from ubatch.cli.server.limits import INLINE_PARSE_BYTES, json_too_deep, off_loop
from ubatch.engine.errors import EngineError, ErrorKind, UbatchError

STATUS: dict[ErrorKind, tuple[int, str]] = {  # llama-server's code and error type for each kind
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.EXCEEDS_CONTEXT: (400, "exceed_context_size_error"),
    ErrorKind.UNAUTHORIZED: (401, "authentication_error"),
    ErrorKind.NOT_FOUND: (404, "not_found_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
    ErrorKind.NOT_SUPPORTED: (501, "not_supported_error"),
    ErrorKind.UNAVAILABLE: (503, "unavailable_error"),
}


def bad_request(message: str) -> EngineError:
    """A request llama-server answers 400 invalid_request_error."""
    return EngineError(ErrorKind.INVALID_REQUEST, message)


def not_started_with(what: str, flag: str) -> EngineError:
    """A feature the server was not started with (llama-server's 501 and its message)."""
    return EngineError(ErrorKind.NOT_SUPPORTED, f"This server does not support {what}. Start it with `{flag}`")


def as_error(e: Exception) -> UbatchError:
    """An exception as an error of a kind: one of ours as it is, a RecursionError the client's
    400 (only its input can nest that deeply), anything else (a bug) an internal error naming its type."""
    if isinstance(e, UbatchError):
        return e
    if isinstance(e, RecursionError):
        return bad_request(f"The request nests too deeply to process ({e}): flatten it")
    return EngineError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}")


def error_body(e: Exception) -> tuple[int, dict[str, Any]]:
    """The status code and llama-server's `{"error": {"code", "message", "type", ...}}`."""
    err = as_error(e)
    code, json_type = STATUS[err.kind]
    return code, sj.error_json(code, _shown(err.message), json_type, **err.details)


def error_response(e: Exception) -> JSONResponse:
    code, body = error_body(e)
    return JSONResponse(body, status_code=code)


def error_event(e: Exception) -> bytes:
    """The SSE event that ends a stream with an error."""
    return sj.sse(error_body(e)[1])


def type_name(v: Any) -> str:
    """JSON's name for a value's type, as llama-server's error messages spell it."""
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), "null" if v is None else type(v).__name__
    )


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _is_text(s: str) -> bool:
    """False for a str holding a lone UTF-16 surrogate (the JSON escape "\\ud800" decodes to
    one: a str that is not Unicode text and cannot be written as UTF-8)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate_at(body: Any) -> str | None:
    """The path of the first string or key in a parsed body that holds a lone surrogate, or None.
    The decoder joins a valid pair into one code point, so any surrogate left is lone."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, str) and not _is_text(x):
            return where or "(body)"
        if isinstance(x, dict):
            for k, y in x.items():
                name = f"{where}.{_shown(k)}" if where else _shown(k)
                if not _is_text(k):
                    return name
                stack.append((name, y))
        elif isinstance(x, list):
            stack.extend((f"{where}[{i}]", y) for i, y in enumerate(x))
    return None


async def read_json(request: Request) -> Any:
    """The request body as JSON text in UTF-8 (RFC 8259; llama-server reads nothing else); an
    empty body is `{}`. Invalid UTF-8, NaN, Infinity and lone UTF-16 surrogates are a 400,
    wherever they are: llama-server's parser refuses them too, and text that is not Unicode
    would otherwise fail later, in the tokenizer, the response or /slots (which shows the prompt).
    So is JSON nested deeper than --max-json-depth. A large body is parsed on the request
    workers (cli/server/limits.py), not on the event loop."""
    raw = await request.body()
    server = getattr(request.app.state, "server", None)
    depth = getattr(getattr(server, "options", None), "max_json_depth", DEFAULT_MAX_JSON_DEPTH)
    if len(raw) <= INLINE_PARSE_BYTES:
        return parse_json(raw, depth)
    return await off_loop(parse_json, raw, depth)


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> Any:
    """`read_json`'s parse of a body already read."""
    if not raw.strip():
        return {}
    if json_too_deep(raw, max_depth):
        raise bad_request(
            f"Invalid JSON in the request body: nested deeper than {max_depth} levels;"
            " flatten it, or start the server with a larger --max-json-depth"
        )
    try:
        text = raw.decode("utf-8-sig")
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"Invalid JSON in the request body: {e}") from None
    if "\\u" in text and (where := lone_surrogate_at(body)) is not None:
        raise bad_request(
            f"Invalid JSON in the request body: field '{where}' holds a lone UTF-16 surrogate"
            " (not Unicode text); send UTF-8 or a complete surrogate pair"
        )
    return body


Route = Callable[[Request], Awaitable[Response]]


def answering(errors: Callable[[Exception], Response]) -> Callable[[Route], Route]:
    """llama.cpp's ex_wrapper: request errors become their 4xx JSON, anything else a 500, in the
    body shape `errors` writes (llama-server's, or an API family's own such as Anthropic's)."""

    def decorate(fn: Route) -> Route:
        @functools.wraps(fn)
        async def wrapper(request: Request) -> Response:
            try:
                return await fn(request)
            except Exception as e:  # never a dead server: report it and keep serving
                return errors(e)

        return wrapper

    return decorate


api = answering(error_response)
