"""The read-only routes of `ubatch server`: /health, /models, /props, /slots, /metrics and
ubatch's own /iterations.

Monitoring and client discovery read the scheduler's state without submitting work; keeping
them apart from the completion path keeps each module about one thing.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ..engine.server_task import RequestError, TaskParams
from . import server_json as sj
from . import server_metrics
from .server_http import api
from .server_state import ServerState


def _require_slots_endpoint(st: ServerState) -> None:
    if not st.options.slots:
        raise RequestError(
            "This server does not support slots endpoint. Start it with `--slots`", 501, "not_supported_error"
        )


def add_info_routes(app: FastAPI, st: ServerState) -> None:
    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/models")
    @app.get("/v1/models")
    @api
    async def models(request: Request) -> Response:
        m, s = st.sch().ctx.model, st.sch()
        hp, mid = m.hparams, st.model_id
        meta = {
            "vocab_type": 1,
            "n_vocab": hp.n_vocab,
            "n_ctx_train": hp.n_ctx_train,
            "n_ctx": s.n_ctx_slot,
            "n_embd": hp.n_embd,
            "n_params": m.n_params,
            "size": m.size_bytes,
        }
        return JSONResponse(
            {
                "models": [
                    {
                        "name": mid,
                        "model": mid,
                        "modified_at": "",
                        "size": "",
                        "digest": "",
                        "type": "model",
                        "description": "",
                        "tags": [""],
                        "capabilities": ["completion"],
                        "parameters": "",
                        "details": {
                            "parent_model": "",
                            "format": "gguf",
                            "family": hp.arch,
                            "families": [hp.arch],
                            "parameter_size": "",
                            "quantization_level": "",
                        },
                    }
                ],
                "object": "list",
                "data": [
                    {
                        "id": mid,
                        "aliases": [st.options.alias] if st.options.alias else [],
                        "tags": [],
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "llamacpp",
                        "meta": meta,
                    }
                ],
            }
        )

    @app.get("/props")
    @api
    async def props(request: Request) -> Response:
        s = st.sch()
        m, vocab = s.ctx.model, s.vocab
        assert st.chat is not None
        tmpl = st.chat.source or st.chat.name
        return JSONResponse(
            {
                "default_generation_settings": {
                    "id": 0,
                    "id_task": -1,
                    "n_ctx": s.n_ctx_slot,
                    "speculative": False,
                    "is_processing": False,
                    "params": TaskParams(
                        n_predict=st.defaults.n_predict,
                        sampling=st.defaults.sampling,
                        cache_prompt=st.defaults.cache_prompt,
                    ).to_json(),
                },
                "total_slots": len(s.slots),
                "model_alias": st.model_id,
                "model_path": str(m.path),
                "modalities": {"vision": False, "audio": False},
                "chat_template": tmpl,
                "bos_token": vocab.token_text(vocab.bos),
                "eos_token": vocab.token_text(vocab.eos),
                "build_info": sj.BUILD_INFO,
                "is_sleeping": False,
                "endpoint_slots": st.options.slots,
                "endpoint_props": False,
                "endpoint_metrics": st.options.metrics,
            }
        )

    @app.get("/slots")
    @api
    async def slots(request: Request) -> Response:
        _require_slots_endpoint(st)
        s = st.sch()
        if request.query_params.get("fail_on_no_slot") not in (None, "", "0", "false") and all(x.busy for x in s.slots):
            raise RequestError("no slot available", 503, "unavailable_error")
        return JSONResponse([server_metrics.slot_json(x, s.vocab.detokenize) for x in s.slots])

    @app.get("/iterations")
    @api
    async def iterations(request: Request) -> Response:
        """ubatch's own: the last decode calls (rows per sequence) and slot releases."""
        _require_slots_endpoint(st)
        s = st.sch()
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
                    for r in list(s.records)
                ],
                "releases": [
                    {
                        "slot": r.slot,
                        "id_task": r.task,
                        "reason": r.reason,
                        "iteration": r.iteration,
                        "cancel_iteration": r.cancel_iteration,
                    }
                    for r in list(s.releases)
                ],
            }
        )

    @app.get("/metrics")
    @api
    async def metrics(request: Request) -> Response:
        if not st.options.metrics:
            raise RequestError(
                "This server does not support metrics endpoint. Start it with `--metrics`", 501, "not_supported_error"
            )
        s = st.sch()
        return PlainTextResponse(
            server_metrics.metrics_text(s),
            media_type="text/plain; version=0.0.4",
            headers={"Process-Start-Time-Unix": str(int(s.stats.t_start))},
        )
