"""Anthropic's Messages API on `ubatch server`: POST /v1/messages and /v1/messages/count_tokens,
as llama-server serves them (server-context.cpp post_anthropic_messages, server-task.cpp
to_json_anthropic*), so that Anthropic's own clients work against a local model.

A request is translated into an OpenAI chat body (cli/server/request/anthropic.py) and prepared
by the chat route's own code (the template with its tools, the tool grammar, the parameters);
its task is queued like a /v1/chat/completions one, and the reply is read by the same plan
(cli/server/request/tools.py) into thinking, text and tool_use blocks. Streams use
Anthropic's named events (message_start, content_block_*, message_delta, message_stop). Errors of
this route family are Anthropic's `{"type": "error", "error": {"type", "message"}}` with
llama-server's status codes (its `code` kept inside `error`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server import responses as sj
from ubatch.cli.server.http import answering, error_body, read_json
from ubatch.cli.server.limits import off_loop, prepare_off_loop
from ubatch.cli.server.request.anthropic import anthropic_chat
from ubatch.cli.server.request.chat import chat_prompt
from ubatch.cli.server.request.oai import oai_chat_body
from ubatch.cli.server.routes.completion import Prepared, prepare
from ubatch.cli.server.state import ServerState
from ubatch.cli.server.stream import EventStream, Reader, ReplyStream
from ubatch.engine.chat.tools import ChatDelta, ChatMessageOut
from ubatch.engine.serve.prompt_progress import Progress
from ubatch.engine.serve.task import Final, Partial, Task

# llama-server's error types as Anthropic's (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    "exceed_context_size_error": "invalid_request_error",
    "server_error": "api_error",
    "not_supported_error": "invalid_request_error",
    "unavailable_error": "overloaded_error",
}


def anthropic_error(e: Exception) -> tuple[int, dict[str, Any]]:
    """The status code and Anthropic's error body for an exception."""
    code, body = error_body(e)
    err = dict(body["error"])
    err["type"] = ERROR_TYPES.get(err["type"], err["type"])
    return code, {"type": "error", "error": err}


def error_json_response(e: Exception) -> JSONResponse:
    code, body = anthropic_error(e)
    return JSONResponse(body, status_code=code)


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One named server-sent event (format_anthropic_sse)."""
    return b"event: " + event.encode() + b"\ndata: " + sj.dumps(data) + b"\n\n"


anthropic_api = answering(error_json_response)  # cli/server/http.py's `api`, Anthropic's error body


# -- the request -----------------------------------------------------------------------------


def prepare_messages(st: ServerState, body: Any) -> Prepared:
    """The request in OpenAI chat terms, then the chat route's own preparation (template with
    tools, tool grammar, parameters, tokens), on the request workers."""
    prep = prepare(st, oai_chat_body(anthropic_chat(body)), "chat")
    prep.params.timings_per_token = prep.params.stream  # message_start reports the cached prompt
    return prep


def count_tokens(st: ServerState, body: Any) -> int:
    """The rendered prompt's token count (handle_count_tokens), on the request workers."""
    chat = chat_prompt(st, oai_chat_body(anthropic_chat(body, count_only=True)))
    return len(st.tokenize_prompt([chat.text]))


# -- the response ----------------------------------------------------------------------------


def stop_reason(ev: Final, msg: ChatMessageOut) -> str:
    """end_turn / stop_sequence / tool_use for a reply that ended by itself, else max_tokens.
    (llama-server says end_turn for a stop sequence too; Anthropic's clients expect stop_sequence.)"""
    if ev.stop_type not in ("eos", "word"):
        return "max_tokens"
    if msg.tool_calls:
        return "tool_use"
    return "stop_sequence" if ev.stop_type == "word" and ev.stopping_word else "end_turn"


def usage(n_prompt: int, n_cached: int, n_out: int) -> dict[str, int]:
    return {"cache_read_input_tokens": n_cached, "input_tokens": n_prompt - n_cached, "output_tokens": n_out}


def tool_input(arguments: str) -> Any:
    """A call's arguments as the block's input object ({} when they are not a JSON object)."""
    try:
        v = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def tool_use_id(call_id: str) -> str:
    """Anthropic's toolu_ id for the parser's call_ id (the same in a stream and its message)."""
    return "toolu_" + call_id.removeprefix("call_") if call_id else sj.new_id("toolu_")


def message_json(ev: Final, msg: ChatMessageOut, mid: str, model: str) -> dict[str, Any]:
    """The whole reply (to_json_anthropic): thinking, then text, then the tool_use blocks."""
    content: list[dict[str, Any]] = []
    if msg.reasoning_content:  # no signature: nothing to verify for a local model
        content.append({"type": "thinking", "thinking": msg.reasoning_content, "signature": ""})
    if msg.content:
        content.append({"type": "text", "text": msg.content})
    for c in msg.tool_calls:
        content.append({"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": tool_input(c.arguments)})
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(ev, msg),
        "stop_sequence": ev.stopping_word or None,
        "usage": usage(ev.n_prompt, ev.timings.cache_n, ev.n_decoded),
    }


class Blocks:
    """A stream's content blocks from the parser's deltas: one open at a time, each stopped
    before the next starts, as Anthropic's own streams order them (llama-server stops them
    all at the end; clients accept both)."""

    def __init__(self) -> None:
        self.kind = ""  # the open block: "thinking", "text", "tool_use" or "" (none)
        self.index = -1
        self.tool = -1  # the call the open tool_use block belongs to
        self.out: list[bytes] = []

    def close(self) -> None:
        if not self.kind:
            return
        if self.kind == "thinking":  # Anthropic's clients expect a signature before the stop
            self._delta({"type": "signature_delta", "signature": ""})
        self.out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.kind = ""

    def _open(self, kind: str, block: dict[str, Any]) -> None:
        self.close()
        self.kind, self.index = kind, self.index + 1
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        self.out.append(sse("content_block_start", start))

    def _delta(self, delta: dict[str, Any]) -> None:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        self.out.append(sse("content_block_delta", body))

    def add(self, d: ChatDelta) -> None:
        if d.reasoning_content:
            if self.kind != "thinking":
                self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._delta({"type": "thinking_delta", "thinking": d.reasoning_content})
        if d.content:
            if self.kind != "text":
                self._open("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": d.content})
        for t in d.tool_calls:
            if self.kind != "tool_use" or self.tool != t.index:
                block = {"type": "tool_use", "id": tool_use_id(t.id or ""), "name": t.name or "", "input": {}}
                self._open("tool_use", block)
                self.tool = t.index
            if t.arguments:
                self._delta({"type": "input_json_delta", "partial_json": t.arguments})

    def take(self) -> list[bytes]:
        out, self.out = self.out, []
        return out


async def stream_events(reader: Reader, first: Any, mid: str, model: str, prep: Prepared) -> AsyncIterator[bytes]:
    """Anthropic's event stream of one task, from its first event to message_stop."""
    plan, blocks, ev = prep.plan, Blocks(), first
    reply = ReplyStream(plan) if plan is not None else None
    pending = prep.prefill  # the continued message's text starts the reply, as llama-server's
    started = False
    try:
        while True:
            if (end := Reader.stream_end(ev)) is not None:
                if end:
                    yield end
                return
            if isinstance(ev, Partial | Final):
                if not started:
                    started = True
                    cached = ev.timings.cache_n if ev.timings is not None else 0
                    head: dict[str, Any] = {
                        "id": mid,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": usage(ev.n_prompt, cached, 0),
                    }
                    yield sse("message_start", {"type": "message_start", "message": head})
                    yield sse("ping", {"type": "ping"})
                text, last = pending + (ev.text if isinstance(ev, Partial) else ev.content), isinstance(ev, Final)
                pending = ""
                if reply is not None:
                    for d in await reply.feed(text, last):
                        blocks.add(d)
                elif text:
                    blocks.add(ChatDelta(content=text))
                if isinstance(ev, Final):
                    blocks.close()
                    for chunk in blocks.take():
                        yield chunk
                    msg = reply.message if reply is not None and reply.message is not None else ChatMessageOut()
                    delta = {"stop_reason": stop_reason(ev, msg), "stop_sequence": ev.stopping_word or None}
                    out = {"type": "message_delta", "delta": delta, "usage": {"output_tokens": ev.n_decoded}}
                    yield sse("message_delta", out)
                    yield sse("message_stop", {"type": "message_stop"})
                    return
                for chunk in blocks.take():
                    yield chunk
            ev = await reader.get()
    except Exception as e:  # the stream cannot die mid-body: cancel the task, end with an error event
        reader.disconnect()
        yield error_event(e)


def error_event(e: Exception) -> bytes:
    return sse("error", anthropic_error(e)[1])


async def messages(st: ServerState, request: Request) -> Response:
    """One /v1/messages request: a task, then its events as one body or as a stream."""
    eng = st.eng()
    reader: Reader | None = None
    try:
        with eng.loop.arrival():  # until its task is in (cli/server/routes/completion.py)
            body = await read_json(request)
            prep = await prepare_off_loop(request.receive, prepare_messages, st, body)
            model = body["model"] if isinstance(body.get("model"), str) else st.model_id
            reader = Reader(eng.loop, request.receive)
            task = Task(st.ids.next(), prep.token_lists[0], prep.params, reader.sink, 0, prep.texts[0])
            reader.tasks = [task]
            eng.loop.submit(task)
        ev = await reader.get()
        while isinstance(ev, Progress):
            ev = await reader.get()
        # llama-server: a stream's first error is a plain error response (here in Anthropic's shape)
        if (end := reader.ending(ev, error_json_response)) is not None:
            return end
        mid = sj.new_id("msg_")
        if prep.params.stream:
            return EventStream(stream_events(reader, ev, mid, model, prep), reader)
        reader.close()
        assert isinstance(ev, Final)  # a task that does not stream sends only its Final
        text = prep.prefill + ev.content
        msg = await off_loop(prep.plan.parse_reply, text) if prep.plan is not None else ChatMessageOut(text)
        return JSONResponse(message_json(ev, msg, mid, model))
    except BaseException:  # a bug (or a cancelled handler): free the slot, then the 500
        if reader is not None:
            reader.disconnect()
            reader.close()
        raise


def add_anthropic_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/v1/messages")
    @anthropic_api
    async def create_message(request: Request) -> Response:
        return await messages(st, request)

    @app.post("/v1/messages/count_tokens")
    @anthropic_api
    async def count_message_tokens(request: Request) -> Response:
        body = await read_json(request)
        return JSONResponse({"input_tokens": await prepare_off_loop(request.receive, count_tokens, st, body)})
