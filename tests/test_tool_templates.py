"""Tools, calls and tool results rendered through real templates (llama.cpp's models/templates),
as llama.cpp passes them: `tools` in OpenAI's form, arguments as objects."""

from __future__ import annotations

import json
from pathlib import Path

from ubatch.engine.chat.template import ChatTemplate
from ubatch.engine.chat.tools import ToolFormat, prepare_chat

TEMPLATES = Path(__file__).parent / "data" / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
    },
}
ROUND_TRIP: list[dict[str, object]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call0abcd",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call0abcd", "content": "18C, sunny"},
]


def template(name: str, eos: str = "") -> ChatTemplate:
    src = (TEMPLATES / f"{name}.jinja").read_text()
    return ChatTemplate("jinja", src, "test", bos_token="<s>", eos_token=eos)


def test_qwen25_tools_and_round_trip() -> None:
    p = prepare_chat(template("Qwen-Qwen2.5-7B-Instruct"), ROUND_TRIP, tools=[WEATHER])
    assert p.format is ToolFormat.HERMES
    expected = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert p.prompt == expected
    assert p.grammar is not None and p.grammar.lazy and p.grammar.trigger_words == ("<tool_call>",)


def test_mistral_nemo_round_trip() -> None:
    p = prepare_chat(template("mistralai-Mistral-Nemo-Instruct-2407", "</s>"), ROUND_TRIP, tools=[WEATHER])
    assert p.format is ToolFormat.MISTRAL_NEMO
    assert p.prompt.startswith('[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"')
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris"}, "id": "call0abcd"}]' in p.prompt
    assert '[TOOL_RESULTS]{"content": 18C, sunny, "call_id": "call0abcd"}[/TOOL_RESULTS]' in p.prompt
    assert p.preserved_tokens == ("[TOOL_CALLS]",)


def test_llama31_tools_in_the_user_turn() -> None:
    p = prepare_chat(template("meta-llama-Llama-3.1-8B-Instruct"), ROUND_TRIP, tools=[WEATHER])
    assert p.format is ToolFormat.LLAMA3
    assert json.dumps(WEATHER, indent=4) in p.prompt  # the template's tojson(indent=4)
    assert '{"name": "get_weather", "parameters": {"location": "Paris"}}<|eot_id|>' in p.prompt
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"18C, sunny"<|eot_id|>' in p.prompt


def test_tool_choice_none_still_renders_the_tools() -> None:
    """llama.cpp shows the template the tools whatever tool_choice is: "none" only drops the
    grammar and the call parsing, so the prompt (and its token count) is llama-server's."""
    auto = prepare_chat(template("Qwen-Qwen2.5-7B-Instruct"), ROUND_TRIP, tools=[WEATHER])
    none = prepare_chat(template("Qwen-Qwen2.5-7B-Instruct"), ROUND_TRIP, tools=[WEATHER], tool_choice="none")
    assert none.prompt == auto.prompt and "<tools>" in none.prompt
    assert none.format is ToolFormat.CONTENT_ONLY and none.grammar is None
    assert none.parse('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>').tool_calls == []


def test_gemma2_generic_polyfill() -> None:
    p = prepare_chat(template("google-gemma-2-2b-it"), ROUND_TRIP, tools=[WEATHER])
    assert p.format is ToolFormat.GENERIC and p.grammar is not None and not p.grammar.lazy
    assert p.prompt.startswith("<start_of_turn>user\nYou can call the following tools:\n")
    assert (
        '<start_of_turn>model\n{"tool_call": {"name": "get_weather", "arguments": {"location": "Paris"}}}<end_of_turn>'
        in p.prompt
    )
    assert '{"tool_response": {"tool": "get_weather", "content": "18C, sunny"}}' in p.prompt


def test_qwen3_thinking_switch() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    on = prepare_chat(template("Qwen-Qwen3-0.6B"), msgs)
    off = prepare_chat(template("Qwen-Qwen3-0.6B"), msgs, enable_thinking=False)
    assert on.prompt.endswith("<|im_start|>assistant\n")
    assert off.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not on.thinking_forced_open and not off.thinking_forced_open


def test_deepseek_r1_forced_open() -> None:
    p = prepare_chat(template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"), [{"role": "user", "content": "2+2?"}])
    assert p.prompt.endswith("<｜Assistant｜><think>\n") and p.thinking_forced_open
    m = p.parse("Two plus two.\n</think>\n\n4")
    assert (m.reasoning_content, m.content) == ("Two plus two.", "4")
