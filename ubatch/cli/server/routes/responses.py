"""OpenAI's Responses API: POST /v1/responses (and /responses) and /v1/responses/input_tokens.

A Responses request is a chat completion in another shape (cli/server/request/responses.py
converts the body, as llama-server does), so it runs the chat path: the same prompt, tools,
grammar and reply parser. What differs is the answer: a `response` object whose `output` holds
reasoning, message and function_call items, or, streamed, the Responses event sequence
(response.created, .in_progress, output_item.added/.done around each item's deltas, and
response.completed), every event numbered by `sequence_number`. Items are sent one after
another, each closed before the next opens, as OpenAI sends them. Nothing is stored.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server import responses as sj
from ubatch.cli.server.http import api, read_json
from ubatch.cli.server.limits import off_loop, prepare_off_loop
from ubatch.cli.server.request.chat import chat_prompt
from ubatch.cli.server.request.oai import oai_chat_body
from ubatch.cli.server.request.responses import responses_to_chat
from ubatch.cli.server.request.tools import ChatPlan
from ubatch.cli.server.routes.completion import Prepared, guarded, prepare
from ubatch.cli.server.state import ServerState
from ubatch.cli.server.stream import EventStream, Reader, ReplyStream
from ubatch.engine.chat.tools import ChatDelta, ChatMessageOut
from ubatch.engine.serve.prompt_progress import Progress
from ubatch.engine.serve.task import Final, Partial, Task, Timings, with_prefill


def _rid(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _usage(f: Final) -> dict[str, Any]:
    return {
        "input_tokens": f.n_prompt,
        "input_tokens_details": {"cached_tokens": f.timings.cache_n},
        "output_tokens": f.n_decoded,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": f.n_prompt + f.n_decoded,
    }


@dataclass(slots=True)
class Head:
    """What every response object of a request repeats: its id, the request's settings, the model."""

    id: str
    model: str
    request: dict[str, Any]
    temperature: float
    top_p: float
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], final: Final | None = None) -> dict[str, Any]:
        r = self.request
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.get("instructions"),
            "max_output_tokens": r.get("max_output_tokens"),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": self.temperature,
            "text": r.get("text") if isinstance(r.get("text"), dict) else {"format": {"type": "text"}},
            "tool_choice": r.get("tool_choice", "auto"),
            "tools": r.get("tools") if isinstance(r.get("tools"), list) else [],
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": _usage(final) if final is not None else None,
            "metadata": r.get("metadata") if isinstance(r.get("metadata"), dict) else {},
        }
        if final is not None:
            obj["completed_at"] = int(time.time())
        return obj


def _status(f: Final) -> str:
    """ "completed" for a reply that ended by itself, "incomplete" when max_output_tokens (or
    the context) cut it."""
    return "completed" if f.stop_type in ("eos", "word") else "incomplete"


def _fc_ids(call_id: str) -> tuple[str, str]:
    """A call's (item id, call_id): llama-server's "fc_" + the id, and the call id itself."""
    return "fc_" + call_id.removeprefix("call_"), call_id


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    item_id, cid = _fc_ids(call_id)
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": cid,
        "name": name,
        "arguments": arguments,
    }


def output_items(msg: ChatMessageOut) -> list[dict[str, Any]]:
    """A whole reply's output items: its reasoning, its text, then each call (llama-server's order)."""
    out = []
    if msg.reasoning_content:
        out.append(_reasoning_item(_rid("rs_"), msg.reasoning_content, "completed"))
    if msg.content:
        out.append(_message_item(_rid("msg_"), msg.content, "completed"))
    out += [_call_item(c.id, c.name, c.arguments, "completed") for c in msg.tool_calls]
    return out


@dataclass(slots=True)
class _Item:
    kind: str  # "reasoning" | "message" | "function_call"
    id: str
    text: str = ""  # the text, reasoning or arguments so far
    call_id: str = ""
    name: str = ""
    tool_index: int = -1


class EventWriter:
    """The Responses event stream of one reply, from its deltas: items opened and closed in
    order, each event numbered."""

    def __init__(self, head: Head) -> None:
        self.head, self.seq = head, 0
        self.items: list[_Item] = []
        self.open: _Item | None = None

    def _ev(self, kind: str, **data: Any) -> dict[str, Any]:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return body

    def start(self) -> list[dict[str, Any]]:
        r = self.head.response("in_progress", [])
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def progress(self, ev: Progress) -> list[dict[str, Any]]:
        """A prompt_progress report (return_progress): llama-server sends it on a
        response.in_progress event."""
        r = self.head.response("in_progress", [])
        return [self._ev("response.in_progress", response=r, prompt_progress=sj.progress_json(ev))]

    def _item_json(self, it: _Item, status: str) -> dict[str, Any]:
        if it.kind == "message":
            return _message_item(it.id, it.text, status)
        if it.kind == "reasoning":
            return _reasoning_item(it.id, it.text, status)
        return _call_item(it.call_id, it.name, it.text, status)

    def _open(self, it: _Item) -> list[dict[str, Any]]:
        out = self._close()
        self.items.append(it)
        self.open = it
        n = len(self.items) - 1
        added = self._item_json(it, "in_progress")
        if it.kind != "function_call":
            added["content"] = []
        out.append(self._ev("response.output_item.added", output_index=n, item=added))
        if it.kind == "message":
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
            out.append(
                self._ev("response.content_part.added", item_id=it.id, output_index=n, content_index=0, part=part)
            )
        elif it.kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            out.append(
                self._ev("response.content_part.added", item_id=it.id, output_index=n, content_index=0, part=part)
            )
        return out

    def _close(self) -> list[dict[str, Any]]:
        it, self.open = self.open, None
        if it is None:
            return []
        n, out = self.items.index(it), []
        where = {"item_id": it.id, "output_index": n}
        if it.kind == "message":
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": it.text}
            out.append(self._ev("response.output_text.done", **where, content_index=0, text=it.text, logprobs=[]))
            out.append(self._ev("response.content_part.done", **where, content_index=0, part=part))
        elif it.kind == "reasoning":
            part = {"type": "reasoning_text", "text": it.text}
            out.append(self._ev("response.reasoning_text.done", **where, content_index=0, text=it.text))
            out.append(self._ev("response.content_part.done", **where, content_index=0, part=part))
        else:
            out.append(self._ev("response.function_call_arguments.done", **where, name=it.name, arguments=it.text))
        out.append(self._ev("response.output_item.done", output_index=n, item=self._item_json(it, "completed")))
        return out

    def _text(self, kind: str, prefix: str, event: str, text: str, **extra: Any) -> list[dict[str, Any]]:
        """A piece of reasoning or answer text: into the open item of that kind (opened first
        when another kind is open), as its delta event."""
        out: list[dict[str, Any]] = []
        if self.open is None or self.open.kind != kind:
            out += self._open(_Item(kind, _rid(prefix)))
        assert self.open is not None
        self.open.text += text
        where = {"item_id": self.open.id, "output_index": len(self.items) - 1}
        out.append(self._ev(event, **where, content_index=0, delta=text, **extra))
        return out

    def deltas(self, deltas: list[ChatDelta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if d.reasoning_content:
                out += self._text("reasoning", "rs_", "response.reasoning_text.delta", d.reasoning_content)
            if d.content:
                out += self._text("message", "msg_", "response.output_text.delta", d.content, logprobs=[])
            for tc in d.tool_calls:
                if tc.id is not None:
                    item_id, _ = _fc_ids(tc.id)
                    out += self._open(_Item("function_call", item_id, "", tc.id, tc.name or "", tc.index))
                it = next((x for x in self.items if x.kind == "function_call" and x.tool_index == tc.index), None)
                if it is None or not tc.arguments:
                    continue
                it.text += tc.arguments
                where = {"item_id": it.id, "output_index": self.items.index(it)}
                out.append(self._ev("response.function_call_arguments.delta", **where, delta=tc.arguments))
        return out

    def finish(self, final: Final) -> list[dict[str, Any]]:
        out = self._close()
        status = _status(final)
        output = [self._item_json(it, "completed") for it in self.items]
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._ev(kind, response=self.head.response(status, output, final)))
        return out


def _sse(events: list[dict[str, Any]], timings: Timings | None = None) -> bytes:
    """Events as SSE; `timings` (llama-server's telemetry) on the last of them, as there."""
    if events and timings is not None:
        events[-1]["timings"] = sj.timings_json(timings)
    return b"".join(b"event: " + e["type"].encode() + b"\n" + sj.sse(e) for e in events)


async def _events(reader: Reader, first: Any, head: Head, plan: ChatPlan) -> AsyncIterator[bytes]:
    writer, reply = EventWriter(head), ReplyStream(plan)
    yield _sse(writer.start())
    ev = first
    while True:
        if (end := Reader.stream_end(ev)) is not None:
            if end:
                yield end
            return
        if isinstance(ev, Progress):
            yield _sse(writer.progress(ev))
        elif isinstance(ev, Partial):
            # timings_per_token: each token's events carry the timings so far
            if chunk := _sse(writer.deltas(await reply.feed(ev.text, False)), ev.timings):
                yield chunk
        elif isinstance(ev, Final):
            deltas = await reply.feed(ev.content, True)
            yield _sse(writer.deltas(deltas) + writer.finish(ev), ev.timings)
            return
        ev = await reader.get()


def _prepare(st: ServerState, body: Any) -> tuple[dict[str, Any], Prepared]:
    chat = responses_to_chat(body)
    prep = prepare(st, chat, "chat")
    prep.params.n_cmpl = 1  # one output per response
    return body, prep


async def create_response(st: ServerState, request: Request) -> Response:
    eng = st.eng()
    reader: Reader | None = None
    try:
        with eng.loop.arrival():  # until its task is in (cli/server/routes/completion.py)
            body, prep = await prepare_off_loop(request.receive, _prepare, st, await read_json(request))
            params = prep.params
            model = body["model"] if isinstance(body.get("model"), str) else st.model_id
            head = Head(_rid("resp_"), model, body, params.sampling.temp, params.sampling.top_p)
            plan = prep.chat.plan
            reader = Reader(eng.loop, request.receive)
            reader.tasks = [Task(st.ids.next(), prep.token_lists[0], params, reader.sink, 0, prep.texts[0])]
            eng.loop.submit(reader.tasks[0])
        ev = await reader.get()
        if (end := reader.ending(ev)) is not None:
            return end
        if isinstance(ev, Partial | Final):
            ev = with_prefill(ev, prep.prefill)
        if params.stream:
            return EventStream(guarded(_events(reader, ev, head, plan), reader), reader)
        while not isinstance(ev, Final):
            if (end := reader.ending(ev)) is not None:
                return end
            ev = await reader.get()
        reader.close()
        final = ev
        msg = await off_loop(plan.parse_reply, final.content)
        return JSONResponse(head.response(_status(final), output_items(msg), final))
    except BaseException:
        if reader is not None:
            reader.disconnect()
            reader.close()
        raise


def _input_tokens(st: ServerState, body: Any) -> Response:
    """What the request's prompt would count, as llama-server's handle_count_tokens answers."""
    n = len(st.tokenize_prompt([chat_prompt(st, oai_chat_body(responses_to_chat(body))).text]))
    return JSONResponse({"input_tokens": n, "object": "response.input_tokens"})


def add_responses_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/responses")
    @app.post("/v1/responses")
    @api
    async def responses(request: Request) -> Response:
        return await create_response(st, request)

    @app.post("/responses/input_tokens")
    @app.post("/v1/responses/input_tokens")
    @api
    async def responses_input_tokens(request: Request) -> Response:
        return await prepare_off_loop(request.receive, _input_tokens, st, await read_json(request))
