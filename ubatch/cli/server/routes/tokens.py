"""The tokenizer routes of `ubatch server`: /tokenize, /detokenize, /apply-template and the
chat token count (/chat/completions/input_tokens).

They let a client see exactly what the completion routes would feed the model, without running
it; they need the vocabulary and the chat template, never a slot. Their work (rendering,
tokenizing, writing a long token list as JSON) runs on the request workers, never on the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server.http import api, bad_request, read_json
from ubatch.cli.server.limits import off_loop, prepare_off_loop
from ubatch.cli.server.request.chat import chat_prompt
from ubatch.cli.server.request.oai import oai_chat_body
from ubatch.cli.server.request.params import get_bool, mixed_parts
from ubatch.cli.server.state import ServerState


def _apply_template(st: ServerState, body: Any) -> Response:
    return JSONResponse({"prompt": chat_prompt(st, oai_chat_body(body)).text})


def _input_tokens(st: ServerState, body: Any) -> Response:
    n = len(st.tokenize_prompt([chat_prompt(st, oai_chat_body(body)).text]))
    return JSONResponse({"input_tokens": n, "object": "response.input_tokens"})


def _tokenize(st: ServerState, body: Any) -> Response:
    vocab = st.handle().vocab
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    content = body.get("content")
    if content is None:
        return JSONResponse({"tokens": []})
    add_special = get_bool(body, "add_special", False)
    parse_special = get_bool(body, "parse_special", True)
    with_pieces = get_bool(body, "with_pieces", False)
    toks = st.tokenize_prompt(mixed_parts(content, "content"), add_special, parse_special)
    if not with_pieces:
        return JSONResponse({"tokens": toks})
    out = []
    for t in toks:
        b = vocab.token_to_piece(t, True)
        try:
            piece: Any = b.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(b)
        out.append({"id": t, "piece": piece})
    return JSONResponse({"tokens": out})


def _detokenize(st: ServerState, body: Any) -> Response:
    vocab = st.handle().vocab
    toks = body.get("tokens", []) if isinstance(body, dict) else None
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise bad_request("Field 'tokens': expected an array of token ids")
    if any(not 0 <= t < vocab.n_tokens for t in toks):
        raise bad_request("Field 'tokens': token id out of range")
    text = b"".join(vocab.token_to_piece(t, True) for t in toks).decode("utf-8", errors="replace")
    return JSONResponse({"content": text})


def add_token_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/apply-template")
    @api
    async def apply_template(request: Request) -> Response:
        """The prompt /chat/completions would run, without running it."""
        return await prepare_off_loop(request.receive, _apply_template, st, await read_json(request))

    @app.post("/chat/completions/input_tokens")
    @app.post("/v1/chat/completions/input_tokens")
    @api
    async def input_tokens(request: Request) -> Response:
        """How many tokens a chat request's prompt is (llama-server's handle_count_tokens)."""
        return await prepare_off_loop(request.receive, _input_tokens, st, await read_json(request))

    @app.post("/tokenize")
    @api
    async def tokenize(request: Request) -> Response:
        return await off_loop(_tokenize, st, await read_json(request))

    @app.post("/detokenize")
    @api
    async def detokenize(request: Request) -> Response:
        return await off_loop(_detokenize, st, await read_json(request))
