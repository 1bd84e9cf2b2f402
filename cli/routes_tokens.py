"""The tokenizer routes of `ubatch server`: /tokenize, /detokenize and /apply-template.

They let a client see exactly what the completion routes would feed the model, without running
it; they need the vocabulary and the chat template, never a slot.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ..engine.server_task import RequestError
from .server_http import api, read_json
from .server_oai import oai_chat_body
from .server_params import get_bool, split_prompts
from .server_state import ServerState


def add_token_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/apply-template")
    @api
    async def apply_template(request: Request) -> Response:
        body = oai_chat_body(await read_json(request))
        return JSONResponse({"prompt": st.render(body["messages"])})

    @app.post("/tokenize")
    @api
    async def tokenize(request: Request) -> Response:
        body, vocab = await read_json(request), st.sch().vocab
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        content = body.get("content")
        if content is None:
            return JSONResponse({"tokens": []})
        add_special = get_bool(body, "add_special", False)
        parse_special = get_bool(body, "parse_special", True)
        with_pieces = get_bool(body, "with_pieces", False)
        parts = split_prompts(content, "content")
        if len(parts) != 1:
            raise RequestError("Field 'content': expected a string or an array of tokens and strings")
        toks = st.tokenize_prompt(parts[0], add_special, parse_special)
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

    @app.post("/detokenize")
    @api
    async def detokenize(request: Request) -> Response:
        body, vocab = await read_json(request), st.sch().vocab
        toks = body.get("tokens", []) if isinstance(body, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise RequestError("Field 'tokens': expected an array of token ids")
        if any(not 0 <= t < vocab.n_tokens for t in toks):
            raise RequestError("Field 'tokens': token id out of range")
        text = b"".join(vocab.token_to_piece(t, True) for t in toks).decode("utf-8", errors="replace")
        return JSONResponse({"content": text})
