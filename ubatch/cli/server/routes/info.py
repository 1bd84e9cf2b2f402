"""The monitoring routes of `ubatch server`: /health, /models, /props (and POST /props), /slots,
/metrics and ubatch's own /iterations.

Monitoring and client discovery read the engine without submitting work: the fixed facts from
its handle, what moves from a snapshot the engine thread takes between two iterations
(engine/serve/snapshot.py); keeping them apart from the completion path keeps each module about
one thing.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server import metrics as server_metrics
from ubatch.cli.server.http import api, not_started_with
from ubatch.cli.server.info import models_json, props_json
from ubatch.cli.server.state import ServerState
from ubatch.engine.errors import EngineError, ErrorKind


def _require_slots_endpoint(st: ServerState) -> None:
    if not st.options.slots:
        raise not_started_with("slots endpoint", "--slots")


def add_info_routes(app: FastAPI, st: ServerState) -> None:
    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/models")
    @app.get("/v1/models")
    @api
    async def models(request: Request) -> Response:
        return JSONResponse(models_json(st))

    @app.get("/props")
    @api
    async def props(request: Request) -> Response:
        return JSONResponse(props_json(st))

    @app.post("/props")
    @api
    async def set_props(request: Request) -> Response:
        """llama-server changes no property here either; it answers only when --props allows it."""
        if not st.options.props:
            raise not_started_with("changing global properties", "--props")
        return JSONResponse({"success": True})

    @app.get("/slots")
    @api
    async def slots(request: Request) -> Response:
        _require_slots_endpoint(st)
        snap = await asyncio.to_thread(st.eng().loop.snapshot)
        if request.query_params.get("fail_on_no_slot") and all(x.busy for x in snap.slots):  # any value
            raise EngineError(ErrorKind.UNAVAILABLE, "no slot available")
        detokenize = st.handle().vocab.detokenize
        return JSONResponse([server_metrics.slot_json(x, detokenize) for x in snap.slots])

    @app.get("/iterations")
    @api
    async def iterations(request: Request) -> Response:
        """ubatch's own: the last decode calls (rows per sequence) and slot releases."""
        _require_slots_endpoint(st)
        s = await asyncio.to_thread(st.eng().loop.snapshot)
        return JSONResponse(
            {
                "iteration": s.iteration,
                "records": [
                    {
                        "index": r.index,
                        "n_tokens": r.n_tokens,
                        "n_outputs": r.n_outputs,
                        "rows": {str(k): v for k, v in r.rows.items()},
                        "n_gen": r.n_gen,
                        "n_prompt": r.n_prompt,
                        "n_ubatch": r.n_ubatch,
                        "ms": r.ms,
                        "retries": r.retries,
                        "n_queued": r.n_queued,
                    }
                    for r in s.records
                ],
                "releases": [
                    {
                        "slot": r.slot,
                        "id_task": r.task,
                        "reason": r.reason,
                        "iteration": r.iteration,
                        "cancel_iteration": r.cancel_iteration,
                    }
                    for r in s.releases
                ],
            }
        )

    @app.get("/metrics")
    @api
    async def metrics(request: Request) -> Response:
        if not st.options.metrics:
            raise not_started_with("metrics endpoint", "--metrics")
        s = await asyncio.to_thread(st.eng().loop.snapshot)
        since, st.scraped = st.scraped, replace(s.stats.total)  # the gauges' window: since the last read
        return Response(  # exactly llama-server's content type (Starlette would add a charset)
            server_metrics.metrics_text(s, since).encode(),
            headers={"Content-Type": "text/plain; version=0.0.4", "Process-Start-Time-Unix": str(int(s.stats.t_start))},
        )
