"""`ubatch server`'s Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) driven by
Anthropic's own client, unchanged, against a real loopback server: text replies whole and
streamed (the same greedy text as /v1/chat/completions), a tool_use -> tool_result round trip
whose input validates against the tool's schema, token counts, errors in Anthropic's shape, and
the x-api-key header. The tiny model's GGUF carries Qwen 2.5's template (tools, <tool_call>).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import gguf
import httpx
import jsonschema
import numpy as np
import pytest
from test_server import Live, start_server_engine
from tiny_models import TinySpec, write_tiny_model

from ubatch.cli.server.app import ServerEngine, ServerOptions, create_app
from ubatch.cli.server.request.anthropic import anthropic_chat
from ubatch.cli.server.routes.anthropic import Blocks, add_anthropic_routes
from ubatch.engine.chat.tools import ChatDelta, ToolCallDelta

# Qwen 2.5 Instruct's chat template (as llama.cpp's models/templates has it): Hermes tool calls
QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
    '{%- endif %}{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"location": {"type": "string", "enum": ["Paris", "Tokyo"]}},  # bounded: a random model
    "required": ["location"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
HELLO = [{"role": "user", "content": "hello world"}]


def _qwen_template(w: gguf.GGUFWriter, _rng: np.random.Generator) -> None:
    w.add_chat_template(QWEN25)


def _app(eng: ServerEngine, options: ServerOptions) -> Any:
    app = create_app(eng, options)
    if not any(getattr(r, "path", "") == "/v1/messages" for r in app.routes):
        add_anthropic_routes(app, app.state.server)  # until cli/server/app.py registers them
    return app


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerEngine]:
    """-np 1 -c 2048: Qwen's tool system prompt is some 700 of the tiny vocabulary's tokens."""
    path = write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-qwen-tmpl.gguf", TinySpec(extra=_qwen_template))
    eng = start_server_engine(path, 1, 2048)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def url(engine: ServerEngine) -> Iterator[str]:
    live = Live(_app(engine, ServerOptions(alias="tiny")))
    yield live.url
    live.close()


def client(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_create_and_stream_a_text_reply(url: str) -> None:
    c = client(url)
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 6, "system": "be brief", "messages": HELLO}
    kw["extra_body"] = {"temperature": 0}  # this client version has no sampling arguments of its own
    msg = c.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens") and 1 <= msg.usage.output_tokens <= 6
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 10
    text = "".join(b.text for b in msg.content if b.type == "text")
    # the same conversation on the OpenAI route: the same prompt, so the same greedy reply
    oai = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "system", "content": "be brief"}, *HELLO], "max_tokens": 6, "temperature": 0},
        timeout=60,
    ).json()
    assert text == oai["choices"][0]["message"]["content"]

    with c.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types
    assert [b.model_dump(include={"type", "text"}) for b in final.content] == [
        b.model_dump(include={"type", "text"}) for b in msg.content
    ]
    assert final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    if text:  # one text block: started, its deltas, stopped
        assert "content_block_start" in types and "content_block_stop" in types
        assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text


def test_tool_use_round_trip(url: str) -> None:
    c = client(url)
    ask = [{"role": "user", "content": "what is the weather in Paris?"}]
    # one call (the grammar's whitespace lets a random model write ~300 tokens for it)
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 400, "tools": [WEATHER]}
    kw["extra_body"] = {"temperature": 0}
    msg = c.messages.create(messages=ask, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw)
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and calls, msg
    for call in calls:
        assert call.name == "get_weather" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, WEATHER_SCHEMA)

    named = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    with c.messages.stream(messages=ask, tool_choice=named, **kw) as s:
        events = list(s)
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [b.input for b in calls]
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)

    results = [{"type": "tool_result", "tool_use_id": b.id, "content": "sunny, 25 C"} for b in calls]
    history = [*ask, {"role": "assistant", "content": msg.content}, {"role": "user", "content": results}]
    reply = c.messages.create(messages=history, **{**kw, "max_tokens": 4})
    assert reply.type == "message" and reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the tool result is in the prompt: more tokens than the question alone
    n_ask = c.messages.count_tokens(model="tiny", messages=ask, tools=[WEATHER]).input_tokens
    n_history = c.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER]).input_tokens
    assert n_history > n_ask + len("sunny, 25 C")
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == n_history


def test_count_tokens_is_the_prompt_the_reply_reads(url: str) -> None:
    c = client(url)
    n = c.messages.count_tokens(model="tiny", system="be brief", messages=HELLO).input_tokens
    msg = c.messages.create(model="tiny", max_tokens=1, system="be brief", messages=HELLO)
    assert n == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 10
    with_tools = c.messages.count_tokens(model="tiny", messages=HELLO, tools=[WEATHER]).input_tokens
    assert with_tools > n + 100  # Qwen's tool system prompt


def test_empty_messages_and_wrong_typed_fields_are_refused(url: str) -> None:
    """An empty conversation is a 400 (as in OpenAI's and Anthropic's APIs; llama-server renders
    the bare generation prompt), and so are `tools`, `response_format` of the wrong JSON type
    (llama-server ignores them, so a client's mistake went unnoticed)."""
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 2, "messages": []}, timeout=60)
    assert r.status_code == 400 and "at least one message" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"max_tokens": 2, "messages": []}, timeout=60)
    assert r.status_code == 400 and "at least one message" in r.json()["error"]["message"]
    hi = [{"role": "user", "content": "hi"}]
    for field, value, says in (
        ("tools", True, "Field 'tools': expected an array, got boolean"),
        ("tools", {"type": "function"}, "Field 'tools': expected an array, got object"),
        ("response_format", True, "Field 'response_format': expected an object, got boolean"),
        ("response_format", "json_object", "Field 'response_format': expected an object, got string"),
    ):
        r = httpx.post(url + "/v1/chat/completions", json={"max_tokens": 1, "messages": hi, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"] == says, r.text
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 1, "messages": hi, "tools": True}, timeout=60)
    assert r.status_code == 400 and "tools: expected an array, got boolean" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": {}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == "Expected 'messages' to be an array"


def test_errors_in_anthropic_shape(url: str) -> None:
    c = client(url)
    bad: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"messages": HELLO, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        {"messages": HELLO, "stop_sequences": "x"},
    ]
    for body in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="tiny", max_tokens=4, **body)
        assert e.value.status_code == 400
        err = e.value.body
        assert isinstance(err, dict) and err["type"] == "error", err
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"], err
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == "'messages' is required"
    # max_tokens may be left out, as llama-server allows (4096); the tiny model's first token is a
    # newline, so stopping there spares it generating until the context is full
    r = httpx.post(url + "/v1/messages", json={"messages": HELLO, "stop_sequences": ["\n"]}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message"
    assert r.json()["stop_reason"] == "stop_sequence"
    # a prompt longer than the context: llama-server's 400, in Anthropic's shape
    r = httpx.post(url + "/v1/messages", json={"messages": [{"role": "user", "content": "a " * 3000}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_x_api_key(engine: ServerEngine) -> None:
    live = Live(_app(engine, ServerOptions(alias="tiny", api_keys=("sekrit",))))
    try:
        try:
            msg = client(live.url, "sekrit").messages.create(model="tiny", max_tokens=2, messages=HELLO)
        except anthropic.AuthenticationError:
            pytest.fail("cli/server/app.py's Gate must accept the x-api-key header (Anthropic's clients send it)")
        assert msg.type == "message"
        with pytest.raises(anthropic.AuthenticationError):
            client(live.url, "wrong").messages.create(model="tiny", max_tokens=2, messages=HELLO)
    finally:
        live.close()


def test_blocks_and_conversion_without_a_server() -> None:
    """What a random model cannot show: thinking before text before calls, each block stopped
    before the next starts (a thinking block with its empty signature), and the conversion of a
    history with thinking, tool_use and tool_result blocks into OpenAI messages."""
    b = Blocks()
    b.add(ChatDelta(reasoning_content="hmm"))
    b.add(ChatDelta(reasoning_content=" ok", content="Let me look."))
    b.add(ChatDelta(tool_calls=(ToolCallDelta(0, "call_x1", "get_weather", '{"location": '),)))
    b.add(ChatDelta(tool_calls=(ToolCallDelta(0, arguments='"Paris"}'),)))
    b.close()
    events = [
        (e.split(b"\n")[0].decode()[7:], json.loads(e.split(b"\n")[1][6:])) for e in b.take() if e.startswith(b"event:")
    ]
    assert [(n, d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type")) for n, d in events] == [
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
    ]
    assert events[8][1]["content_block"] == {"type": "tool_use", "id": "toolu_x1", "name": "get_weather", "input": {}}

    body = anthropic_chat(
        {
            "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "call it", "signature": ""},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"location": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sun"}]},
                        {"type": "text", "text": "and tomorrow?"},
                    ],
                },
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "thinking": {"type": "disabled"},
            "stop_sequences": ["\n\n"],
            "metadata": {"user_id": "u"},
        }
    )
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "call it",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sun"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER_SCHEMA},
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["stop"] == ["\n\n"] and body["max_tokens"] == 4096 and "metadata" not in body
