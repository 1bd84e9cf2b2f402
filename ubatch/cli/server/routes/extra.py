"""The routes llama-server registers for features this server does not have, answered as
llama-server answers them when those features are off or missing, so a client probing for a
feature gets the same answer from both:

* /tools and /cors-proxy: the web UI's built-in tools and MCP proxy are disabled (403);
* /v1/audio/transcriptions: the model takes no audio; /v1/systemone: not a decision model;
* POST /v1/chat/completions/control: no completion has reasoning control armed.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server.http import api, bad_request, read_json
from ubatch.cli.server.stream import live_completion
from ubatch.engine.errors import EngineError, ErrorKind


def _not_supported(message: str) -> EngineError:
    return EngineError(ErrorKind.NOT_SUPPORTED, message)


def add_extra_routes(app: FastAPI) -> None:
    @app.get("/tools")
    @app.post("/tools")
    @app.get("/cors-proxy")
    @app.post("/cors-proxy")
    async def disabled(request: Request) -> Response:
        return JSONResponse({"error": {"message": "this feature is disabled", "type": "feature_disabled"}}, 403)

    @app.post("/audio/transcriptions")
    @app.post("/v1/audio/transcriptions")
    @api
    async def transcriptions(request: Request) -> Response:
        raise _not_supported("The current model does not support audio input.")

    @app.post("/v1/systemone")
    @api
    async def systemone(request: Request) -> Response:
        raise _not_supported("This model is not a decision model")

    @app.post("/v1/chat/completions/control")
    @api
    async def control(request: Request) -> Response:
        body = await read_json(request)
        body = body if isinstance(body, dict) else {}
        cmpl_id, action = body.get("id"), body.get("action")
        if not isinstance(cmpl_id, str) or not cmpl_id:
            raise bad_request("missing completion id")
        if action != "reasoning_end":
            raise bad_request("unknown control action")
        if not live_completion(cmpl_id):
            return JSONResponse({"success": False, "message": "no active completion for this id"})
        return JSONResponse({"success": False, "message": "reasoning control not enabled for this completion"})
