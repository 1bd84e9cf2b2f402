"""`ubatch server`'s OpenAI Responses API (/v1/responses, /v1/responses/input_tokens) driven by
OpenAI's own client, unchanged, against a real loopback server on a tiny model with Qwen 2.5's
template: a text response whole and streamed (the client's stream accumulator checks every
event's order and index), a function_call -> function_call_output -> answer round trip whose
arguments validate against the tool's schema, a streamed call, reasoning items from a thinking
template, the token count, and refusals in OpenAI's error shape. A `grammar` passed through the
body (llama.cpp's own field) makes the random model's text end where a test wants it.
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
from test_server_tools import QWEN25, THINKING, WEATHER, template_file

from ubatch.cli.server.app import ServerOptions, create_app

TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    {
        "type": "function",
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]},
    },
]
HELLO = {"grammar": 'root ::= "Hello there"'}


@pytest.fixture(scope="module")
def urls(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """One engine behind two apps: Qwen 2.5's template, and a thinking template."""
    tmp = tmp_path_factory.mktemp("templates")
    eng = start_server_engine(tiny_gemma, 2, 6144)
    apps = [
        Live(create_app(eng, ServerOptions(alias="tiny", chat_template=template_file(tmp, "q.jinja", QWEN25)))),
        Live(create_app(eng, ServerOptions(alias="tiny", chat_template=template_file(tmp, "t.jinja", THINKING)))),
    ]
    yield apps[0].url, apps[1].url
    for a in apps:
        a.close()
    eng.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_text_whole_and_streamed(urls: tuple[str, str]) -> None:
    c = client(urls[0])
    r = c.responses.create(model="tiny", input="Say hello", instructions="Be brief", max_output_tokens=6)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.output[0].type == "message" and r.output_text
    done = c.responses.create(model="tiny", input="Say hello", max_output_tokens=40, extra_body=HELLO)
    assert done.status == "completed" and done.output_text == "Hello there"
    with c.responses.stream(model="tiny", input="Say hello", max_output_tokens=40, extra_body=HELLO) as s:
        events = list(s)
        final = s.get_final_response()
    assert final.output_text == "Hello there" and final.status == "completed" and final.id.startswith("resp_")
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the token count is the prompt's
    n = httpx.post(urls[0] + "/v1/responses/input_tokens", json={"input": "Say hello"}, timeout=60).json()
    again = c.responses.create(model="tiny", input="Say hello", max_output_tokens=1)
    assert n == {"input_tokens": again.usage.input_tokens if again.usage else -1, "object": "response.input_tokens"}


def test_llama_telemetry_in_the_stream(urls: tuple[str, str]) -> None:
    """llama.cpp's own fields: return_progress reports the prompt on response.in_progress events,
    timings_per_token puts timings on each token's last event, and response.completed has them."""
    body = {"input": "This is a test " * 10, "max_output_tokens": 4, "stream": True, **HELLO}
    body |= {"timings_per_token": True, "return_progress": True}
    with httpx.stream("POST", urls[0] + "/responses", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["total"] > 0
    assert any(e["type"] == "response.output_text.delta" and "timings" in e for e in events)
    assert events[-1]["type"] == "response.incomplete" and "prompt_per_second" in events[-1]["timings"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_function_call_round_trip(urls: tuple[str, str]) -> None:
    c = client(urls[0])
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    required: dict[str, Any] = {  # one call, arguments valid for the schema
        "model": "tiny",
        "input": ask,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 600,
    }
    r = c.responses.create(**required)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER if call.name == "get_weather" else TOOLS[1]["parameters"])
    named = c.responses.create(
        model="tiny",
        input="What time is it?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=600,
    )
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_time"]
    follow: list[Any] = [
        *ask,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21C and sunny"},
    ]
    answer = c.responses.create(
        model="tiny", input=follow, tools=TOOLS, tool_choice="none", max_output_tokens=40, extra_body=HELLO
    )
    assert answer.output_text == "Hello there" and not [o for o in answer.output if o.type == "function_call"]
    prompt_n = httpx.post(
        urls[0] + "/v1/responses/input_tokens",
        json={"input": follow, "tools": TOOLS, "tool_choice": "none"},
        timeout=60,
    )
    assert answer.usage is not None and prompt_n.json()["input_tokens"] == answer.usage.input_tokens
    # streamed: the call's arguments arrive as deltas that add up to the finished item's
    events = list(c.responses.create(**required, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == call.arguments and done[0].arguments == args
    assert events[-1].type == "response.completed"


def test_reasoning_items(urls: tuple[str, str]) -> None:
    c = client(urls[1])
    think = {"grammar": 'root ::= "<think>" "plan it" "</think>" "Hello there"'}
    r = c.responses.create(model="tiny", input="Say hello", max_output_tokens=60, extra_body=think)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Hello there"
    reasoning: Any = r.output[0]
    assert reasoning.content[0].text == "plan it"
    with c.responses.stream(model="tiny", input="Say hello", max_output_tokens=60, extra_body=think) as s:
        events = list(s)
        final = s.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "plan it"
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "Hello there"


def test_refusals(urls: tuple[str, str]) -> None:
    c = client(urls[0])
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in str(e.value.body)
    for body in ({"model": "tiny"}, {"input": 5}, {"input": [{"type": "nonsense"}]}):
        r = httpx.post(urls[0] + "/v1/responses", json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error" and "\n" not in err["message"]
