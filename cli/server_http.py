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

from ..engine.server_task import RequestError
from . import server_json as sj


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(sj.error_json(e.code, e.message, e.type, **e.extra), status_code=e.code)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request) -> Any:
    """The request body as JSON; an empty body is `{}`, NaN and Infinity are rejected."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"Invalid JSON in the request body: {e}") from None


def api(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """llama.cpp's ex_wrapper: request errors become their 4xx JSON, anything else a 500."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except RequestError as e:
            return error_response(e)
        except Exception as e:  # never a dead server: report it and keep serving
            return error_response(RequestError(f"{type(e).__name__}: {e}", 500, "server_error"))

    return wrapper
