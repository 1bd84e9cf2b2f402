"""The completion routes of `ubatch server`: llama-server's native /completion, OpenAI's
/v1/completions and /v1/chat/completions.

All three are one path (read the prompts, fan them out into tasks, await their events) that
differs only in how the body is read and how the results are written, so they share a module.
A chat reply is read by its plan (cli/server/request/tools.py): tool calls, reasoning_content
and finish_reason "tool_calls", whole or as streamed deltas; /v1/responses runs this path too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server import responses as sj
from ubatch.cli.server.http import api, bad_request, error_event, read_json
from ubatch.cli.server.limits import off_loop, prepare_off_loop
from ubatch.cli.server.request.chat import ChatPrompt, chat_prompt
from ubatch.cli.server.request.oai import oai_chat_body, oai_completion_body
from ubatch.cli.server.request.params import parse_params, split_prompts
from ubatch.cli.server.request.tools import ChatPlan
from ubatch.cli.server.resume import StreamSessions
from ubatch.cli.server.state import ServerState
from ubatch.cli.server.stream import EventStream, Reader, sse_events
from ubatch.engine.chat.tools import ChatMessageOut
from ubatch.engine.grammar.tokens import token_table
from ubatch.engine.serve.task import Final, Task, TaskParams, context_error, with_prefill
from ubatch.engine.vocab.vocab import Vocab


def read_prompts(st: ServerState, body: Any, kind: str) -> tuple[dict[str, Any], list[list[str | int]], ChatPrompt]:
    """The native body, its prompts and the chat prompt (the assistant prefill, the tools and
    reasoning plan); kind is "native", "oai" or "chat" (the Responses API is a chat)."""
    if kind == "chat":
        body = oai_chat_body(body)
        chat = chat_prompt(st, body)
        return body, [[chat.text]], chat
    if kind == "oai":
        body = oai_completion_body(body)
    elif not isinstance(body, dict) or "prompt" not in body:
        raise bad_request('"prompt" is required')
    return body, split_prompts(body["prompt"]), ChatPrompt("")


@dataclass(slots=True)
class Prepared:
    """A completion request read and tokenized, ready to become tasks."""

    body: dict[str, Any]
    params: TaskParams
    token_lists: list[list[int]]
    texts: list[str]  # each prompt as text (the /slots view)
    chat: ChatPrompt  # the prefill and the plan (empty but for chat)

    @property
    def prefill(self) -> str:
        return self.chat.prefill

    @property
    def plan(self) -> ChatPlan | None:
        """How a chat reply is read (None: its text is the content, as generated)."""
        return self.chat.plan if self.chat.plan.parse else None


def prepare(st: ServerState, body: Any, kind: str) -> Prepared:
    """Everything before the tasks: the prompt (a chat template rendered), the parameters (a
    grammar compiled, logit_bias tokenized) and the tokens. On the request workers: any of it
    can take seconds for a hostile body, and the event loop serves everyone else meanwhile."""
    s = st.handle()
    vocab = s.vocab
    body, prompts, chat = read_prompts(st, body, kind)
    params = parse_params(body, st.defaults, lambda t: vocab.tokenize(t, False, False), vocab.eog)
    if chat.plan.grammar is not None:  # the tool calls' grammar (no request grammar comes with tools)
        params.grammar = chat.plan.grammar
    if params.grammar is not None:  # the vocabulary's token trie: built once
        token_table(vocab)
    prepared = chat.plan.prepared  # a chat's own preserved tokens replace the body's, as llama-server's
    params.preserved = preserved_tokens(
        prepared.preserved_tokens if prepared is not None else body.get("preserved_tokens"), vocab
    )
    token_lists = [st.tokenize_prompt(p, n_ctx=s.n_ctx_slot) for p in prompts]
    for toks in token_lists:  # before any task runs: one prompt too long fails the whole request
        if (err := context_error(len(toks), s.n_ctx_slot)) is not None:
            raise err
    texts = [
        p[0] if len(p) == 1 and isinstance(p[0], str) else vocab.detokenize(t) for p, t in zip(prompts, token_lists)
    ]
    return Prepared(body, params, token_lists, texts, chat)


def preserved_tokens(texts: Any, vocab: Vocab) -> frozenset[int]:
    """llama-server's preserved_tokens: of the texts, those that are one token (a control token,
    typically) are shown in the reply even without -sp, so its parser sees tool-call and thinking
    markers. Other texts are ignored, as there."""
    if texts is None:
        return frozenset()
    if not isinstance(texts, list | tuple) or not all(isinstance(t, str) for t in texts):
        raise bad_request("Field 'preserved_tokens': expected an array of strings")
    ids = (vocab.tokenize(t, False, True) for t in texts)
    return frozenset(i[0] for i in ids if len(i) == 1)


async def complete(st: ServerState, request: Request, kind: str, body: Any = None) -> Response:
    """One completion request; `body` when the caller read (and rewrote) it (/infill)."""
    eng = st.eng()
    reader: Reader | None = None
    try:
        with eng.loop.arrival():  # until its tasks are in: an idle engine waits, so a burst starts in one batch
            body = await read_json(request) if body is None else body
            prep = await prepare_off_loop(request.receive, prepare, st, body, kind)
            params, body = prep.params, prep.body
            model = body["model"] if isinstance(body.get("model"), str) else st.model_id
            reader = Reader(eng.loop, request.receive)
            n = params.n_cmpl
            for i, (toks, text) in enumerate(zip(prep.token_lists, prep.texts)):
                reader.tasks += [Task(st.ids.next(), toks, params, reader.sink, i * n + j, text) for j in range(n)]
            for t in reader.tasks:
                eng.loop.submit(t)
        conv_id = request.headers.get("x-conversation-id", "") if params.stream else ""
        return await _respond(reader, params.stream, kind, model, prep, request.app.state.streams, conv_id)
    except BaseException:  # a bug (or a cancelled handler): free the slots, then the 500 of `api`
        if reader is not None:
            reader.disconnect()
            reader.close()
        raise


async def _respond(
    reader: Reader, stream: bool, kind: str, model: str, prep: Prepared, streams: StreamSessions, conv_id: str
) -> Response:
    """Await the request's events: the SSE stream (kept for replay under `conv_id` when the
    client sent X-Conversation-Id), or every task's Final as one JSON body."""
    first = await reader.get()
    if (end := reader.ending(first)) is not None:
        return end
    cid = sj.new_id("chatcmpl-")  # llama-server's id for every kind
    reader.register(cid)
    if stream:
        session = streams.create_or_replace(conv_id) if conv_id else None
        chunks = guarded(sse_events(reader, first, kind, cid, model, prep.prefill, prep.plan), reader)
        return EventStream(chunks, reader, session)
    finals: list[Final] = []
    ev = first
    while True:
        if (end := reader.ending(ev)) is not None:
            return end
        if isinstance(ev, Final):
            finals.append(ev)
            if len(finals) == len(reader.tasks):
                break
        ev = await reader.get()
    reader.close()
    finals = [with_prefill(f, prep.prefill) for f in finals]
    if kind == "chat":
        messages = await off_loop(parse_replies, finals, prep.plan)
        return JSONResponse(sj.oai_chat(finals, cid, model, messages))
    if kind == "oai":
        return JSONResponse(sj.oai_completion(finals, cid, model))
    res = [sj.native_final(f, model) for f in sorted(finals, key=lambda f: f.task.index)]
    return JSONResponse(res[0] if len(res) == 1 else res)


def parse_replies(finals: list[Final], plan: ChatPlan | None) -> dict[int, ChatMessageOut] | None:
    """Each choice's reply read by the plan (content, reasoning, calls), by choice index."""
    if plan is None:
        return None
    return {f.task.index: plan.parse_reply(f.content) for f in finals}


async def guarded(chunks: AsyncIterator[bytes], reader: Reader) -> AsyncIterator[bytes]:
    """A stream that cannot die mid-body: an exception while making a chunk cancels the
    request's tasks (their slots are freed at the next iteration) and ends the stream with
    llama-server's error event, as when a task fails; never an ASGI traceback."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:
        reader.disconnect()
        yield error_event(e)


def add_completion_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/completion")
    @app.post("/completions")
    @api
    async def completion(request: Request) -> Response:
        return await complete(st, request, "native")

    @app.post("/v1/completions")
    @api
    async def completions_oai(request: Request) -> Response:
        return await complete(st, request, "oai")

    @app.post("/chat/completions")
    @app.post("/v1/chat/completions")
    @api
    async def chat(request: Request) -> Response:
        return await complete(st, request, "chat")
