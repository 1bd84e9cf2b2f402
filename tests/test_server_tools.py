"""`ubatch server`'s tool calls and reasoning on /v1/chat/completions, driven by OpenAI's own
client, unchanged, against a real loopback server on a tiny model whose template is Qwen 2.5's
(Hermes `<tool_call>` format): a required and a named tool_choice (the grammar makes the random
model's call valid for the tool's schema), streamed calls reassembled by the client, the tool
messages of a round trip rendered, llama-server's refusals, and reasoning_content read out of a
thinking template's `<think>` block (--reasoning-format, the per-request reasoning_format,
-rea off; a reasoning budget, even of 0, leaves the template alone).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from test_server import Live, start_server_engine

from ubatch.cli.server.app import ServerOptions, create_app

# Qwen 2.5 Instruct's chat template, as llama.cpp's models/templates/Qwen-Qwen2.5-7B-Instruct.jinja has it
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# a ChatML template that thinks the way Qwen 3's does: `<think>` blocks, and an empty one
# written into the prompt when enable_thinking is false
THINKING = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 600, "parallel_tool_calls": False}


def template_file(tmp: Path, name: str, text: str) -> str:
    """A --chat-template FILE."""
    path = tmp / name
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def urls(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """One engine behind three apps: Qwen 2.5's template; a thinking template; and that one
    with -rea off."""
    tmp = tmp_path_factory.mktemp("templates")
    qwen, think = template_file(tmp, "qwen25.jinja", QWEN25), template_file(tmp, "think.jinja", THINKING)
    eng = start_server_engine(tiny_gemma, 2, 6144)
    apps = [
        Live(create_app(eng, ServerOptions(alias="tiny", chat_template=qwen))),
        Live(create_app(eng, ServerOptions(alias="tiny", chat_template=think))),
        Live(create_app(eng, ServerOptions(alias="tiny", chat_template=think, reasoning="off"))),
    ]
    yield apps[0].url, apps[1].url, apps[2].url
    for a in apps:
        a.close()
    eng.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _check_call(call: Any, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS and (name is None or call.function.name == name)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_choice(urls: tuple[str, str, str]) -> None:
    c = client(urls[0])
    r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls or []) == 1
    _check_call((choice.message.tool_calls or [])[0])
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named, **GREEDY)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_call((r.choices[0].message.tool_calls or [])[0], "get_time")


def test_streamed_calls_reassemble_to_the_whole_answer(urls: tuple[str, str, str]) -> None:
    c = client(urls[0])
    whole = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
    want = (whole.choices[0].message.tool_calls or [])[0]
    chunks = list(
        c.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", stream=True, **GREEDY
        )
    )
    pieces = [tc for ch in chunks for d in [ch.choices[0].delta] if ch.choices for tc in d.tool_calls or []]
    first, rest = pieces[0], pieces[1:]
    assert first.index == 0 and first.id and first.type == "function" and first.function is not None
    assert first.function.name == want.function.name and first.function.arguments == ""
    assert all(p.index == 0 and p.id is None and p.function is not None and p.function.name is None for p in rest)
    args = "".join(p.function.arguments or "" for p in rest if p.function is not None)
    assert args == want.function.arguments and len(rest) > 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # the client's own accumulator agrees
    with c.chat.completions.stream(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY) as s:
        final = s.get_final_completion()
    got = (final.choices[0].message.tool_calls or [])[0]
    assert got.function.name == want.function.name and got.function.arguments == want.function.arguments
    _check_call(got)


def test_auto_and_none_answer_with_text(urls: tuple[str, str, str]) -> None:
    c = client(urls[0])
    for choice in ("auto", "none"):
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=8)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
        assert r.choices[0].message.content


def test_tool_messages_render_and_refusals(urls: tuple[str, str, str]) -> None:
    url = urls[0]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [
        *ASK,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]
    r = httpx.post(url + "/apply-template", json={"messages": msgs, "tools": TOOLS}, timeout=60)
    prompt = r.json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n21C\n</tool_response>" in prompt and '"name": "get_time"' in prompt
    c = client(url)
    r2 = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4)
    assert r2.choices[0].message.role == "assistant"
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": "sometimes"}, "Invalid tool_choice: sometimes"),
        ({"extra_body": {"grammar": 'root ::= "x"'}}, "Cannot use custom grammar constraints with tools."),
        ({"logprobs": True, "stream": True}, "logprobs is not supported with tools + stream"),
    ]
    for extra, message in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4, **extra)
        assert e.value.status_code == 400 and message in str(e.value.body)
    last = [*ASK, {"role": "assistant", "tool_calls": [call]}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": last, "tools": TOOLS}, timeout=60)
    assert r.status_code == 400 and "tool calls" in r.json()["error"]["message"]


THOUGHT = {"grammar": 'root ::= "<think>" "plan it" "</think>" "Hello there"'}


def test_reasoning_content(urls: tuple[str, str, str]) -> None:
    c = client(urls[1])
    r = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, extra_body=THOUGHT)
    msg: Any = r.choices[0].message
    assert msg.content == "Hello there" and msg.reasoning_content == "plan it"
    none = c.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=60, extra_body={**THOUGHT, "reasoning_format": "none"}
    )
    assert none.choices[0].message.content == "<think>plan it</think>Hello there"
    deltas = [
        ch.choices[0].delta
        for ch in c.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, stream=True, extra_body=THOUGHT)
        if ch.choices
    ]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "plan it"
    assert "".join(d.content or "" for d in deltas) == "Hello there"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body={"reasoning_format": "x"})
    # thinking off: -rea off, or the request's enable_thinking; a budget of 0 is not "off" (as in
    # llama-server it leaves the template alone: the sampler ends a block the model opens)
    off = httpx.post(urls[2] + "/apply-template", json={"messages": ASK}, timeout=60).json()["prompt"]
    on = httpx.post(urls[1] + "/apply-template", json={"messages": ASK}, timeout=60).json()["prompt"]
    assert off.endswith("<think>\n\n</think>\n\n") and on.endswith("assistant\n")
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(urls[1] + "/apply-template", json=body, timeout=60).json()["prompt"] == off
    zero = {"messages": ASK, "reasoning_budget_tokens": 0, "thinking_budget_tokens": 0}
    assert httpx.post(urls[1] + "/apply-template", json=zero, timeout=60).json()["prompt"] == on
