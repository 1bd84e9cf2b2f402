"""The embedding and rerank routes of `ubatch server`: llama-server's native /embedding(s), OpenAI's
/v1/embeddings and the Jina / TEI style /rerank (also /reranking, /v1/rerank, /v1/reranking).

Each input becomes one engine task (engine/serve/embedding_task.py) that the engine thread evaluates
with embeddings on; the answers are written in llama-server's shapes (server-common.cpp's
format_embeddings_response_oaicompat and format_response_rerank).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server.http import api, bad_request, not_started_with, read_json
from ubatch.cli.server.limits import off_loop
from ubatch.cli.server.log import current
from ubatch.cli.server.request.params import get_bool, get_int, split_prompts
from ubatch.cli.server.state import ServerState
from ubatch.cli.server.stream import results
from ubatch.engine.serve.embedding_task import EmbdResult, EmbdTask, input_error


def _model(body: dict[str, Any], st: ServerState) -> str:
    return body["model"] if isinstance(body.get("model"), str) else st.model_id


def _checked(st: ServerState, tokens: list[int]) -> list[int]:
    s = st.handle()
    if (err := input_error(len(tokens), s.pooling, s.causal_attn, s.n_ubatch, s.n_ctx_slot)) is not None:
        raise err
    return tokens


async def _run(st: ServerState, request: Request, prompts: list[list[int]], **kw: Any) -> list[EmbdResult] | Response:
    """One task per prompt, awaited: the results in input order, or the response that ends
    the request (cli/server/stream.py `results`)."""
    ids = [st.ids.next() for _ in prompts]
    res = await results(
        st.eng().loop, request.receive, lambda sink: [EmbdTask(ids[i], p, sink, i, **kw) for i, p in enumerate(prompts)]
    )
    if isinstance(res, Response):
        return res
    out = sorted((r for r in res if isinstance(r, EmbdResult)), key=lambda r: r.task.index)
    if (record := current()) is not None:
        for r in out:
            record.add_final(r.n_tokens, 0)
    return out


def _embedding_prompts(st: ServerState, prompt: Any) -> list[list[int]]:
    """The inputs tokenized and checked (on the request workers: a long input takes a while)."""
    n_ctx = st.handle().n_ctx_slot
    return [_checked(st, st.tokenize_prompt(p, True, True, n_ctx)) for p in split_prompts(prompt, "input")]


def _pooling_origin(st: ServerState) -> str:
    """Where the pooling in force came from: the flag, or the model's metadata."""
    return ", from --pooling" if st.options.pooling is not None else ", the model's own"


async def embeddings(st: ServerState, request: Request, oai: bool) -> Response:
    """llama-server's handle_embeddings_impl: the checks in its order, then one task per input."""
    o, s = st.options, st.handle()
    if not (o.embedding or o.reranking):
        raise not_started_with("embeddings", "--embeddings")
    pooling = s.pooling
    if oai and pooling == "none":
        raise bad_request(  # llama-server's words, then where 'none' came from and the fix
            "Pooling type 'none' is not OAI compatible. Please use a different pooling type "
            f"(the pooling in force is 'none'{_pooling_origin(st)}; restart with --pooling mean, cls or last, "
            "or use /embeddings for one vector per token)"
        )
    if pooling == "rank":
        raise bad_request(
            "Pooling type 'rank' scores query/document pairs: use /rerank, or start with another --pooling"
        )
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "input" in body:
        prompt = body["input"]
    elif "content" in body:
        oai, prompt = False, body["content"]  # "content" is the native field: native answer
    else:
        raise bad_request('"input" or "content" must be provided')
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request("The format to return the embeddings in. Can be either float or base64")
    if isinstance(prompt, list) and not prompt:
        raise bad_request('"input" must not be empty')
    norm = get_int(body, "embd_normalize", o.embd_normalize, lo=-1, hi=1 << 20)  # --embd-normalize
    prompts = await off_loop(_embedding_prompts, st, prompt)
    res = await _run(st, request, prompts, embd_normalize=norm)
    if isinstance(res, Response):
        return res
    if not oai:
        return JSONResponse([{"index": r.task.index, "embedding": r.embedding} for r in res])
    data = []
    for r in res:
        v = r.embedding[0]
        item: dict[str, Any] = {"embedding": v, "index": r.task.index, "object": "embedding"}
        if fmt == "base64":
            item["embedding"] = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
            item["encoding_format"] = "base64"
        data.append(item)
    n = sum(r.n_tokens for r in res)
    usage = {"prompt_tokens": n, "total_tokens": n}
    return JSONResponse({"model": _model(body, st), "object": "list", "usage": usage, "data": data})


def rerank_prompt(st: ServerState, query: str, doc: str) -> list[int]:
    """llama-server's format_prompt_rerank: the model's `rerank` template when it has one, else
    BOS? query EOS? document EOS? (each as the vocabulary adds them)."""
    s = st.handle()
    v, n_ctx = s.vocab, s.n_ctx_slot
    template = s.model.metadata.get("tokenizer.chat_template.rerank")
    if isinstance(template, str):
        text = template.replace("{query}", query).replace("{document}", doc)
        return st.tokenize_prompt([text], False, True, n_ctx)
    q, d = st.tokenize_prompt([query], False, False, n_ctx), st.tokenize_prompt([doc], False, False, n_ctx)
    bos, eos = [v.bos] if v.add_bos else [], [v.eos] if v.add_eos else []
    return bos + q + eos + d + eos


async def rerank(st: ServerState, request: Request) -> Response:
    o, s = st.options, st.handle()
    if not ((o.embedding or o.reranking) and s.pooling == "rank"):
        raise not_started_with("reranking", "--reranking")
    if st.eng().embeddings.head is None:
        raise bad_request(
            "This model has no rank head (no cls / cls.output tensors), so it cannot score documents; use a reranker model"
        )
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "query" not in body:
        raise bad_request('"query" must be provided')
    query = body["query"]
    if not isinstance(query, str):
        raise bad_request('"query" must be a string')
    tei = "texts" in body
    docs = body.get("documents", body.get("texts"))
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise bad_request('"documents" must be a non-empty string array')
    top_n = get_int(body, "top_n", len(docs), lo=0)
    return_text = tei and get_bool(body, "return_text", False)
    prompts = await off_loop(lambda: [_checked(st, rerank_prompt(st, query, d)) for d in docs])
    res = await _run(st, request, prompts, rerank=True)
    if isinstance(res, Response):
        return res
    label = "score" if tei else "relevance_score"
    items: list[dict[str, Any]] = []
    for r in res:
        items.append({"index": r.task.index, label: r.score} | ({"text": docs[r.task.index]} if return_text else {}))
    items = sorted(items, key=lambda x: -x[label])[:top_n]
    if tei:
        return JSONResponse(items)
    n = sum(r.n_tokens for r in res)
    usage = {"prompt_tokens": n, "total_tokens": n}
    return JSONResponse({"model": _model(body, st), "object": "list", "usage": usage, "results": items})


def add_embedding_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/embedding")
    @app.post("/embeddings")
    @api
    async def embedding(request: Request) -> Response:
        return await embeddings(st, request, oai=False)

    @app.post("/v1/embeddings")
    @api
    async def embeddings_oai(request: Request) -> Response:
        return await embeddings(st, request, oai=True)

    @app.post("/rerank")
    @app.post("/reranking")
    @app.post("/v1/rerank")
    @app.post("/v1/reranking")
    @api
    async def reranking(request: Request) -> Response:
        return await rerank(st, request)
