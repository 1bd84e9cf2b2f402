"""The HTTP layer of `ubatch server`: llama-server's routes on FastAPI over the engine's Scheduler.

Handlers never block the engine: they tokenize, submit tasks and await events that the
scheduler thread hands over with `call_soon_threadsafe`. A client that disconnects (stream or
not) cancels its tasks at once; the scheduler frees the slot at its next iteration.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ..engine.chat_template import ChatTemplate
from ..engine.errors import UbatchError
from ..engine.sampling import SamplerParams
from ..engine.scheduler import Scheduler
from ..engine.server_task import (Failed, Final, IdCounter, Partial, RequestError, ServerDefaults,
                                  Task, TaskParams, chat_messages, get_bool, oai_chat_body,
                                  oai_completion_body, parse_params, split_prompts)
from . import server_json as sj

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/api/tags"})


@dataclass
class ServerOptions:
    """Server-wide settings from the command line (llama-server's flags of the same names)."""

    api_keys: tuple[str, ...] = ()
    metrics: bool = False
    slots: bool = True
    alias: str | None = None
    chat_template: str | None = None  # --chat-template NAME|FILE|JINJA
    jinja: bool = True
    n_predict: int = -1
    sampling: SamplerParams = field(default_factory=SamplerParams)
    cache_prompt: bool = True


class ServerState:
    """What the routes read: the options, and the scheduler once the model has loaded."""

    def __init__(self, options: ServerOptions | None = None) -> None:
        self.options = options or ServerOptions()
        self.scheduler: Scheduler | None = None  # None while loading: every route answers 503
        self.defaults = ServerDefaults()
        self.ids = IdCounter()
        self.model_id = self.options.alias or ""
        self.chat: ChatTemplate | None = None

    def attach(self, scheduler: Scheduler) -> None:
        o, m = self.options, scheduler.ctx.model
        self.chat = ChatTemplate.for_model(m, o.chat_template, o.jinja)  # a bad --chat-template fails here
        self.defaults = ServerDefaults(
            sampling=o.sampling, n_predict=o.n_predict, n_ctx_slot=scheduler.n_ctx_slot,
            n_parallel=len(scheduler.slots), n_vocab=m.hparams.n_vocab, cache_prompt=o.cache_prompt,
            n_cache_reuse=scheduler.cache_reuse)
        self.model_id = o.alias or m.path.name
        self.scheduler = scheduler  # last: this makes the server ready


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(sj.error_json(e.code, e.message, e.type, **e.extra), status_code=e.code)


class Gate:
    """ASGI middleware: 503 while loading, then the API key for every non-public route."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            err = None
            if self.state.scheduler is None:
                err = RequestError("Loading model", 503, "unavailable_error")
            elif self.state.options.api_keys and scope["method"] != "OPTIONS" \
                    and scope["path"] not in PUBLIC_PATHS:
                h = {k.lower(): v.decode("latin-1") for k, v in scope["headers"]}
                auth = h.get(b"authorization", "")
                key = auth[7:].strip() if auth.lower().startswith("bearer ") else h.get(b"x-api-key", "")
                if key not in self.state.options.api_keys:
                    err = RequestError("Invalid API Key", 401, "authentication_error")
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Reader:
    """One request's events, moved from the engine thread onto the event loop; watches for the
    client going away and then cancels the request's tasks."""

    GONE = object()

    def __init__(self, scheduler: Scheduler, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.scheduler, self.tasks, self.gone = scheduler, list[Task](), False
        self._watcher = asyncio.ensure_future(self._watch(receive))

    def sink(self, event: Any) -> None:  # called on the engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop has closed (shutdown)
            pass

    async def _watch(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnect()

    def disconnect(self) -> None:
        if not self.gone:
            self.gone = True
            for t in self.tasks:
                self.scheduler.cancel(t)
            self.queue.put_nowait(Reader.GONE)

    def close(self) -> None:
        self._watcher.cancel()

    async def get(self) -> Any:
        return await self.queue.get()


class EventStream(Response):
    """text/event-stream without Content-Length; a failed send counts as a disconnect."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], reader: Reader) -> None:
        self.chunks, self.reader = chunks, reader
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            self.reader.disconnect()
        finally:
            self.reader.close()


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request) -> Any:
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


def create_app(scheduler: Scheduler | None = None, options: ServerOptions | None = None,
               state: ServerState | None = None) -> FastAPI:
    """The FastAPI app. Pass a started scheduler, or a `state` whose scheduler is attached
    later (the CLI serves /health = 503 while the model loads)."""
    st = state or ServerState(options)
    if scheduler is not None:
        st.attach(scheduler)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = st
    app.add_middleware(Gate, state=st)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(StarletteHTTPException)
    async def not_found(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):
            return error_response(RequestError("File Not Found", 404, "not_found_error"))
        return error_response(RequestError(str(exc.detail), exc.status_code, "invalid_request_error"))

    def sch() -> Scheduler:
        assert st.scheduler is not None  # the Gate answers 503 before this
        return st.scheduler

    def render(messages: Any) -> str:
        assert st.chat is not None
        try:
            return st.chat.apply(chat_messages(messages))
        except UbatchError as e:  # a template that rejects these messages: the client's problem
            raise RequestError(str(e)) from None

    def tokenize_prompt(parts: list[str | int], add_special: bool = True,
                        parse_special: bool = True) -> list[int]:
        vocab, out = sch().vocab, []
        for i, p in enumerate(parts):
            if isinstance(p, str):
                out += vocab.tokenize(p, add_special and i == 0, parse_special)
            else:
                out.append(p)
        if any(not 0 <= t < vocab.n_tokens for t in out):
            raise RequestError("Prompt contains invalid tokens")
        return out

    async def complete(request: Request, kind: str) -> Response:
        s, body = sch(), await read_json(request)
        vocab = s.vocab
        if kind == "chat":
            body = oai_chat_body(body)
            prompts = [[render(body["messages"])]]
        elif kind == "oai":
            body = oai_completion_body(body)
            prompts = split_prompts(body["prompt"])
        else:
            if not isinstance(body, dict) or "prompt" not in body:
                raise RequestError('"prompt" is required')
            prompts = split_prompts(body["prompt"])
        params = parse_params(body, st.defaults, lambda t: vocab.tokenize(t, False, False))
        token_lists = [tokenize_prompt(p) for p in prompts]
        for toks in token_lists:
            if len(toks) >= s.n_ctx_slot:
                raise RequestError(
                    f"request ({len(toks)} tokens) exceeds the available context size "
                    f"({s.n_ctx_slot} tokens), try increasing it", 400, "exceed_context_size_error",
                    n_prompt_tokens=len(toks), n_ctx=s.n_ctx_slot)
        model = body["model"] if isinstance(body.get("model"), str) else st.model_id
        reader = Reader(s, request.receive)
        n = params.n_cmpl
        for i, (p, toks) in enumerate(zip(prompts, token_lists)):
            text = p[0] if len(p) == 1 and isinstance(p[0], str) else vocab.detokenize(toks)
            reader.tasks += [Task(st.ids.next(), toks, params, reader.sink, i * n + j, text)
                             for j in range(n)]
        for t in reader.tasks:
            s.submit(t)
        first = await reader.get()
        if first is Reader.GONE:
            reader.close()
            return Response(status_code=499)
        if isinstance(first, Failed):
            reader.disconnect()  # cancel the request's other tasks
            reader.close()
            return error_response(first.error)
        cid = sj.new_id("chatcmpl-" if kind == "chat" else "cmpl-")
        if params.stream:
            return EventStream(stream(reader, first, kind, cid, model), reader)
        finals: list[Final] = []
        ev = first
        while True:
            if ev is Reader.GONE:
                reader.close()
                return Response(status_code=499)
            if isinstance(ev, Failed):
                reader.disconnect()
                reader.close()
                return error_response(ev.error)
            if isinstance(ev, Final):
                finals.append(ev)
                if len(finals) == len(reader.tasks):
                    break
            ev = await reader.get()
        reader.close()
        if kind == "chat":
            return JSONResponse(sj.oai_chat(finals, cid, model))
        if kind == "oai":
            return JSONResponse(sj.oai_completion(finals, cid, model))
        res = [sj.native_final(f, model) for f in sorted(finals, key=lambda f: f.task.index)]
        return JSONResponse(res[0] if len(res) == 1 else res)

    async def stream(reader: Reader, ev: Any, kind: str, cid: str, model: str) -> AsyncIterator[bytes]:
        n_final = 0
        while True:
            if ev is Reader.GONE:
                return
            if isinstance(ev, Failed):
                e = ev.error
                yield sj.sse(sj.error_json(e.code, e.message, e.type, **e.extra))
                return
            if kind == "native":
                chunks = [sj.native_partial(ev) if isinstance(ev, Partial) else sj.native_final(ev, model)]
            elif kind == "oai":
                chunks = sj.oai_completion_chunk(ev, cid, model)
            else:
                chunks = sj.oai_chat_chunks(ev, cid, model)
            for c in chunks:
                yield sj.sse(c)
            if isinstance(ev, Final):
                n_final += 1
                if n_final == len(reader.tasks):
                    if kind != "native":
                        yield b"data: [DONE]\n\n"
                    return
            ev = await reader.get()

    # -- routes ------------------------------------------------------------------------------------
    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/completion")
    @app.post("/completions")
    @api
    async def completion(request: Request) -> Response:
        return await complete(request, "native")

    @app.post("/v1/completions")
    @api
    async def completions_oai(request: Request) -> Response:
        return await complete(request, "oai")

    @app.post("/chat/completions")
    @app.post("/v1/chat/completions")
    @api
    async def chat(request: Request) -> Response:
        return await complete(request, "chat")

    @app.post("/apply-template")
    @api
    async def apply_template(request: Request) -> Response:
        body = oai_chat_body(await read_json(request))
        return JSONResponse({"prompt": render(body["messages"])})

    @app.post("/tokenize")
    @api
    async def tokenize(request: Request) -> Response:
        body, vocab = await read_json(request), sch().vocab
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
        toks = tokenize_prompt(parts[0], add_special, parse_special)
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
        body, vocab = await read_json(request), sch().vocab
        toks = body.get("tokens", []) if isinstance(body, dict) else None
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise RequestError("Field 'tokens': expected an array of token ids")
        if any(not 0 <= t < vocab.n_tokens for t in toks):
            raise RequestError("Field 'tokens': token id out of range")
        text = b"".join(vocab.token_to_piece(t, True) for t in toks).decode("utf-8", errors="replace")
        return JSONResponse({"content": text})

    @app.get("/models")
    @app.get("/v1/models")
    @api
    async def models(request: Request) -> Response:
        m, s = sch().ctx.model, sch()
        hp, mid = m.hparams, st.model_id
        meta = {"vocab_type": 1, "n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train,
                "n_ctx": s.n_ctx_slot, "n_embd": hp.n_embd, "n_params": m.n_params, "size": m.size_bytes}
        return JSONResponse({
            "models": [{"name": mid, "model": mid, "modified_at": "", "size": "", "digest": "",
                        "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
                        "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": hp.arch,
                                                      "families": [hp.arch], "parameter_size": "",
                                                      "quantization_level": ""}}],
            "object": "list",
            "data": [{"id": mid, "aliases": [st.options.alias] if st.options.alias else [], "tags": [],
                      "object": "model", "created": int(time.time()), "owned_by": "llamacpp", "meta": meta}],
        })

    @app.get("/props")
    @api
    async def props(request: Request) -> Response:
        s = sch()
        m, vocab = s.ctx.model, s.vocab
        assert st.chat is not None
        tmpl = st.chat.source or st.chat.name
        return JSONResponse({
            "default_generation_settings": {
                "id": 0, "id_task": -1, "n_ctx": s.n_ctx_slot, "speculative": False,
                "is_processing": False,
                "params": TaskParams(n_predict=st.defaults.n_predict, sampling=st.defaults.sampling,
                                     cache_prompt=st.defaults.cache_prompt).to_json()},
            "total_slots": len(s.slots), "model_alias": st.model_id, "model_path": str(m.path),
            "modalities": {"vision": False, "audio": False}, "chat_template": tmpl,
            "bos_token": vocab.token_text(vocab.bos), "eos_token": vocab.token_text(vocab.eos),
            "build_info": sj.BUILD_INFO, "is_sleeping": False, "endpoint_slots": st.options.slots,
            "endpoint_props": False, "endpoint_metrics": st.options.metrics,
        })

    @app.get("/slots")
    @api
    async def slots(request: Request) -> Response:
        if not st.options.slots:
            raise RequestError("This server does not support slots endpoint. Start it with `--slots`",
                               501, "not_supported_error")
        s = sch()
        if request.query_params.get("fail_on_no_slot") not in (None, "", "0", "false") \
                and all(x.busy for x in s.slots):
            raise RequestError("no slot available", 503, "unavailable_error")
        return JSONResponse([sj.slot_json(x, s.vocab.detokenize) for x in s.slots])

    @app.get("/iterations")
    @api
    async def iterations(request: Request) -> Response:
        """ubatch's own: the last decode calls (rows per sequence) and slot releases."""
        if not st.options.slots:
            raise RequestError("This server does not support slots endpoint. Start it with `--slots`",
                               501, "not_supported_error")
        s = sch()
        return JSONResponse({
            "iteration": s.iteration,
            "records": [{"index": r.index, "n_tokens": r.n_tokens, "n_outputs": r.n_outputs,
                         "rows": {str(k): v for k, v in r.rows.items()}, "n_gen": r.n_gen,
                         "n_prompt": r.n_prompt, "n_ubatch": r.n_ubatch, "ms": r.ms, "retries": r.retries,
                         "n_queued": r.n_queued}
                        for r in list(s.records)],
            "releases": [{"slot": r.slot, "id_task": r.task, "reason": r.reason, "iteration": r.iteration,
                          "cancel_iteration": r.cancel_iteration} for r in list(s.releases)],
        })

    @app.get("/metrics")
    @api
    async def metrics(request: Request) -> Response:
        if not st.options.metrics:
            raise RequestError("This server does not support metrics endpoint. Start it with `--metrics`",
                               501, "not_supported_error")
        s = sch()
        return PlainTextResponse(sj.metrics_text(s), media_type="text/plain; version=0.0.4",
                                 headers={"Process-Start-Time-Unix": str(int(s.stats.t_start))})

    return app
