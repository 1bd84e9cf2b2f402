"""The HTTP layer of `ubatch server`: llama-server's routes on FastAPI over the server's engine.

This module wires the app together: the Gate (503 while loading, then the API key), the
pre-routing edge (cli/server/middleware.py: CORS, the OPTIONS preflight, --api-prefix), the body
guard (cli/server/limits.py: --max-body-size, the body's read timeout),
llama-server's 404 body, the access log (cli/server/log.py) and the route families from
cli/server/routes/ and cli/server/resume.py. A client that disconnects (stream or not) cancels its
tasks at once, unless its stream is resumable (X-Conversation-Id); the scheduler frees the slot
at its next iteration. After shutdown began, new requests get 503.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from ubatch.cli.server import responses as sj
from ubatch.cli.server.http import error_response
from ubatch.cli.server.limits import BodyGuard
from ubatch.cli.server.log import LOG_LEVEL_INFO, AccessLog
from ubatch.cli.server.middleware import Edge
from ubatch.cli.server.resume import StreamSessions, add_resume_routes
from ubatch.cli.server.routes.anthropic import add_anthropic_routes
from ubatch.cli.server.routes.completion import add_completion_routes
from ubatch.cli.server.routes.embedding import add_embedding_routes
from ubatch.cli.server.routes.extra import add_extra_routes
from ubatch.cli.server.routes.infill import add_infill_routes
from ubatch.cli.server.routes.info import add_info_routes
from ubatch.cli.server.routes.lora import add_lora_routes
from ubatch.cli.server.routes.responses import add_responses_routes
from ubatch.cli.server.routes.slots import add_slot_routes
from ubatch.cli.server.routes.tokens import add_token_routes
from ubatch.cli.server.routes.webui import add_webui_routes, public_pages
from ubatch.cli.server.state import ServerEngine, ServerOptions, ServerState
from ubatch.engine.errors import EngineError, ErrorKind
from ubatch.engine.serve.engine_loop import shutdown_error

__all__ = ["PUBLIC_PATHS", "Gate", "ServerEngine", "ServerOptions", "ServerState", "create_app"]

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})  # llama-server's, before its page's assets


class Gate:
    """ASGI middleware: 503 while loading, then the API key for every non-public route."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state
        o = state.options
        self.public = PUBLIC_PATHS | (public_pages(o.webui_path) if o.webui else frozenset())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            err = None
            eng = self.state.engine
            path = scope["path"]
            if eng is None:
                err = EngineError(ErrorKind.UNAVAILABLE, "Loading model")
            elif eng.loop.shutting_down:  # a keep-alive connection after SIGTERM: no new work
                err = shutdown_error()
            elif not is_normal(path):  # `/webui/../x`, `/a//b`, `%2e%2e`: no route or file has such a name
                err = EngineError(ErrorKind.NOT_FOUND, "File Not Found")
            elif self.state.options.api_keys and path not in self.public:
                h = {k.lower(): v.decode("latin-1") for k, v in scope["headers"]}
                auth = h.get(b"authorization", "")
                key = auth[7:].strip() if auth.lower().startswith("bearer ") else h.get(b"x-api-key", "")
                if key not in self.state.options.api_keys:
                    err = EngineError(ErrorKind.UNAUTHORIZED, "Invalid API Key")
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_normal(path: str) -> bool:
    """Whether `path` (percent-decoded, as the server receives it) names itself: no `.` or `..`
    segment, no empty segment, no backslash. The Gate's public set is matched on exact names, and
    a path that normalises to another must not reach a catch-all that serves files."""
    if not path.startswith("/") or "\\" in path or "\0" in path:
        return False
    segments = path[1:].split("/")
    return all(seg not in (".", "..") for seg in segments) and all(segments[:-1])


def create_app(
    engine: ServerEngine | None = None,
    options: ServerOptions | None = None,
    state: ServerState | None = None,
    log_verbosity: int | None = LOG_LEVEL_INFO,
) -> FastAPI:
    """The FastAPI app. Pass a started engine (cli/server/run.py `start_engine`), or a `state`
    whose engine is attached later (the CLI serves /health = 503 while the model loads).
    `log_verbosity` is -lv (None: --log-disable)."""
    st = state or ServerState(options)
    if engine is not None:
        st.attach(engine)
    # no redirect from /health/ to /health: llama-server answers a trailing slash 404
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.server = st
    o = st.options
    app.add_middleware(
        BodyGuard, max_body=o.max_body_size, timeout_s=o.timeout
    )  # after the Gate: no body read for a 401
    app.add_middleware(Gate, state=st)
    app.add_middleware(Edge, options=st.options)  # CORS, preflight, --api-prefix: before the Gate
    app.add_middleware(AccessLog, verbosity=log_verbosity)  # outermost: sees every answer, even the Gate's

    @app.exception_handler(StarletteHTTPException)
    async def not_found(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):
            return error_response(EngineError(ErrorKind.NOT_FOUND, "File Not Found"))
        code = exc.status_code  # no kind of ours: passed through as Starlette raised it
        return JSONResponse(sj.error_json(code, str(exc.detail), "invalid_request_error"), status_code=code)

    app.state.streams = StreamSessions()  # resumable streams (X-Conversation-Id)
    add_info_routes(app, st)
    add_lora_routes(app, st)
    add_completion_routes(app, st)
    add_responses_routes(app, st)
    add_anthropic_routes(app, st)
    add_token_routes(app, st)
    add_resume_routes(app, app.state.streams)
    add_extra_routes(app)
    add_slot_routes(app, st)
    add_infill_routes(app, st)
    add_embedding_routes(app, st)
    if o.webui:  # last: --path serves its folder through a catch-all that must not shadow a route
        add_webui_routes(app, st, o.webui_path)
    return app
