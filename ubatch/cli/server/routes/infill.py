"""POST /infill: fill-in-the-middle code completion, as llama-server builds its prompt
(format_prompt_infill), answered as a native /completion.

The prompt uses the repo-level FIM pattern: `[FIM_REP]myproject\\n`, then each `input_extra`
chunk after `[FIM_SEP]filename\\n` (or a `--- snippet ---` line when the vocabulary has no
FIM_SEP), then `[FIM_SEP]filename\\n[FIM_PRE]prefix[FIM_SUF]suffix[FIM_MID]prompt`. The prefix
and suffix are cut to fit one batch (3:1); the extra chunks fill what the context has left.
A model whose vocabulary has no FIM prefix, suffix and middle tokens answers 501.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from ubatch.cli.server.http import api, bad_request, read_json
from ubatch.cli.server.limits import off_loop
from ubatch.cli.server.request.params import mixed_parts, split_prompts
from ubatch.cli.server.routes.completion import complete
from ubatch.cli.server.state import ServerState
from ubatch.engine.errors import EngineError, ErrorKind
from ubatch.engine.vocab.tables import AUTO_SPECIAL_TEXTS

_SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's chunk separator without FIM_SEP


def fim_tokens(st: ServerState) -> dict[str, int | None]:
    """The FIM token ids: from the GGUF keys, else the lowest id with one of llama.cpp's texts."""
    s = st.handle()
    md, vocab = s.model.metadata, s.vocab
    names = ("fim_pre", "fim_suf", "fim_mid", "fim_rep", "fim_sep")
    keys = {n: md.get(f"tokenizer.ggml.{n}_token_id") for n in names}
    out: dict[str, int | None] = {n: v if isinstance(v, int) else None for n, v in keys.items()}
    want = {t: n for n in names if out[n] is None for t in AUTO_SPECIAL_TEXTS.get(n, ())}
    if want:
        for i in range(vocab.n_tokens):
            n = want.get(vocab.token_text(i))
            if n is not None and out[n] is None:
                out[n] = i
    return out


def _check(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise bad_request('"prompt" must be a string')
    for k in ("input_prefix", "input_suffix"):
        if k not in body:
            raise bad_request(f'"{k}" is required')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise bad_request('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise bad_request('extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise bad_request('extra_context chunk\'s "filename" field must be a string')
    return body


def infill_prompt(st: ServerState, body: dict[str, Any], fim: dict[str, int | None]) -> list[int]:
    s = st.handle()
    vocab, d = s.vocab, st.defaults

    def tok(text: str) -> list[int]:
        return vocab.tokenize(text, False, False)

    prefix = st.tokenize_prompt(mixed_parts(body["input_prefix"], "input_prefix"), False, False)
    suffix = st.tokenize_prompt(mixed_parts(body["input_suffix"], "input_suffix"), False, False)
    prompt = st.tokenize_prompt(split_prompts(body.get("prompt", ""))[0], False, True)
    extra: list[int] = []
    if fim["fim_rep"] is not None:
        extra += [fim["fim_rep"], *tok("myproject\n")]
    for chunk in body.get("input_extra", []):
        if fim["fim_sep"] is not None:
            extra += [fim["fim_sep"], *tok(chunk.get("filename", "tmp") + "\n")]
        else:
            extra += tok(_SNIPPET)
        extra += tok(chunk["text"])
    if fim["fim_sep"] is not None:
        extra += [fim["fim_sep"], *tok("filename\n")]
    n_batch = s.n_batch
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, d.n_ctx_slot - n_batch - 2 * d.n_predict), len(extra))
    pre, suf, mid = fim["fim_pre"], fim["fim_suf"], fim["fim_mid"]
    assert pre is not None and suf is not None and mid is not None  # else the route answered 501
    head = [pre, *prefix[len(prefix) - n_prefix :], *prompt]
    tail = [suf, *suffix[:n_suffix]]
    inp = [*([vocab.bos] if vocab.add_bos else []), *head]
    return [*extra[len(extra) - n_extra :], *inp, *tail, mid]


def add_infill_routes(app: FastAPI, st: ServerState) -> None:
    cache: dict[int, dict[str, int | None]] = {}  # by engine handle: read once

    @app.post("/infill")
    @api
    async def infill(request: Request) -> Response:
        fim = cache.get(id(st.handle())) or cache.setdefault(id(st.handle()), await off_loop(fim_tokens, st))
        missing = [
            w for k, w in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")) if fim[k] is None
        ]
        if missing:
            why = "".join(f"{w} token is missing. " for w in missing)
            raise EngineError(ErrorKind.NOT_SUPPORTED, f"Infill is not supported by this model: {why}")
        body = _check(await read_json(request))
        prompt = await off_loop(infill_prompt, st, body, fim)  # tokenizing: on the request workers
        return await complete(st, request, "native", {**body, "prompt": prompt})
