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


def test_functionary_v32_round_trip_and_generation_prompt() -> None:
    """Functionary v3.2 writes calls as `>>>name` then the arguments, concatenated as strings (so
    they reach it as the JSON text they are); the prompt ends at `>>>`, where the model names
    the recipient."""
    p = prepare_chat(
        template("meetkai-functionary-medium-v3.2"), ROUND_TRIP, tools=[WEATHER], with_generation_prompt=True
    )
    assert p.format is ToolFormat.FUNCTIONARY_V3_2 and p.preserved_tokens == (">>>all",)
    assert '>>>get_weather\n{"location": "Paris"}<|eot_id|>' in p.prompt
    assert "// Current weather\ntype get_weather = (_: {\nlocation: string,\n}) => any;" in p.prompt
    assert p.prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n>>>")
    assert p.generation_prompt == "<|start_header_id|>assistant<|end_header_id|>\n\n>>>"
    m = p.parse('all\nChecking.>>>get_weather\n{"location": "Oslo"}')
    assert m.content == "Checking." and [(c.name, c.arguments) for c in m.tool_calls] == [
        ("get_weather", '{"location": "Oslo"}')
    ]
    assert p.grammar is not None and p.grammar.lazy


def test_qwen3_coder_and_qwen35_xml_calls() -> None:
    p = prepare_chat(template("Qwen3-Coder"), ROUND_TRIP, tools=[WEATHER])
    assert p.format is ToolFormat.QWEN3_CODER and not p.thinking_end_tags
    assert "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n</function>" in p.prompt
    assert p.grammar is not None and p.grammar.trigger_words == ("<tool_call>", "<function=get_weather>")
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    q = prepare_chat(template("Qwen3.5-4B"), msgs, tools=[WEATHER], with_generation_prompt=True)
    assert q.format is ToolFormat.QWEN3_CODER and q.thinking_forced_open
    assert q.generation_prompt == "<|im_start|>assistant\n<think>\n"
    # a reasoning budget closes the block as the template writes it; a call also ends it
    assert (q.thinking_start_tag, q.thinking_end_tags) == ("<think>", ("\n</think>", "</think>", "<tool_call>"))
    text = "Look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n</function>\n</tool_call>"
    m = q.parse(text)
    assert m.reasoning_content == "Look it up." and json.loads(m.tool_calls[0].arguments) == {"location": "Paris"}


def test_gpt_oss_history_and_channels() -> None:
    """GPT-OSS reads an assistant's reasoning from `thinking` (moved there from reasoning_content);
    its replies are read by channel, tools or not; a reasoning budget watches the analysis channel."""
    history = [ROUND_TRIP[0], {**ROUND_TRIP[1], "reasoning_content": "Look it up."}, ROUND_TRIP[2]]
    p = prepare_chat(template("openai-gpt-oss-120b"), history, tools=[WEATHER])
    assert p.format is ToolFormat.GPT_OSS and p.prompt.endswith("<|start|>assistant")
    assert "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>" in p.prompt
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Paris"}<|call|>'
        in p.prompt
    )
    assert (p.thinking_start_tag, p.thinking_end_tags) == ("<|channel|>analysis<|message|>", ("<|end|>",))
    assert "<|channel|>" in p.preserved_tokens and p.grammar is not None and p.grammar.lazy
    plain = prepare_chat(template("openai-gpt-oss-120b"), [{"role": "user", "content": "hi"}])
    assert plain.format is ToolFormat.GPT_OSS and plain.grammar is None
    m = plain.parse("<|channel|>analysis<|message|>Greet.<|end|><|start|>assistant<|channel|>final<|message|>Hi!")
    assert (m.reasoning_content, m.content) == ("Greet.", "Hi!")
