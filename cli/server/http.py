"""The plumbing between Starlette and the routes of `ubatch server`: reading a JSON body, and
turning a `RequestError` (or any other exception) into llama-server's error JSON.

Every route module and the app's middleware answer errors the same way, so that lives here once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server import responses as sj
from ubatch.engine.serve.task import RequestError


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(sj.error_json(e.code, _shown(e.message), e.type, **e.extra), status_code=e.code)


def internal_error(e: Exception) -> RequestError:
    """An exception that is not the client's fault: llama-server's 500 server_error."""
    return e if isinstance(e, RequestError) else RequestError(f"{type(e).__name__}: {e}", 500, "server_error")


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
    would otherwise fail later, in the tokenizer, the response or /slots (which shows the prompt)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8-sig")
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"Invalid JSON in the request body: {e}") from None
    if "\\u" in text and (where := lone_surrogate_at(body)) is not None:
        raise RequestError(
            f"Invalid JSON in the request body: field '{where}' holds a lone UTF-16 surrogate"
            " (not Unicode text); send UTF-8 or a complete surrogate pair"
        )
    return body


def api(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """llama.cpp's ex_wrapper: request errors become their 4xx JSON, anything else a 500."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except Exception as e:  # never a dead server: report it and keep serving
            return error_response(internal_error(e))

    return wrapper
