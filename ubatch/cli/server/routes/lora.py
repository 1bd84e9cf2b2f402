"""GET and POST /lora-adapters, as llama-server answers them: the loaded adapters with their
global scales, and new global scales (unlisted adapters at 0) for the requests that start after.
A request's own `lora` field overrides them for that request (cli/server/request/params.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server.http import api, bad_request, read_json
from ubatch.cli.server.request.params import get_lora
from ubatch.cli.server.state import ServerState


def adapters_json(st: ServerState) -> list[dict[str, Any]]:
    """server_task_result_get_lora's array: id, path, scale, task_name, prompt_prefix."""
    scales = st.eng().loop.lora_scales()
    return [
        {
            "id": a.id,
            "path": a.path,
            "scale": scales.get(a.id, 0.0),
            "task_name": a.task_name,
            "prompt_prefix": a.prompt_prefix,
        }  # fmt: skip
        for a in st.handle().plan.loras
    ]


def add_lora_routes(app: FastAPI, st: ServerState) -> None:
    @app.get("/lora-adapters")
    @api
    async def get_lora_adapters(request: Request) -> Response:
        return JSONResponse(adapters_json(st))

    @app.post("/lora-adapters")
    @api
    async def set_lora_adapters(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body, list):
            raise bad_request("Request body must be an array")
        st.eng().loop.set_lora_scales(get_lora(body, len(st.handle().plan.loras), "body"))
        return JSONResponse({"success": True})
