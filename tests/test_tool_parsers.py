"""Tool-call and reasoning parsing per format, on outputs written as the real models write them;
whole and streamed in random chunk sizes (the deltas must add up to the whole answer)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ubatch.engine.chat.tools import ChatStreamParser, Tool, ToolFormat, detect_tool_format, parse_chat_output
from ubatch.engine.chat.tools.types import ChatMessageOut

QWEN_ONE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n</tool_call>'
)
QWEN_TWO = (
    "Let me check both cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Tokyo \\"JP\\" \\u00e9"}}\n</tool_call>'
)
QWEN3_THINK = (
    "<think>\nThe user wants the weather. I should call get_weather with <tool_call> syntax.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Berlin"}}\n</tool_call>'
)
LLAMA3 = '{"name": "get_weather", "parameters": {"location": "San Francisco, CA"}}'
LLAMA3_TAG = '<|python_tag|>{"name": "python", "parameters": {"code": "print(1 + 1)"}}'
NEMO = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris"}, "id": "a1B2c3D4e"}, {"name": "get_time", "arguments": {"tz": "CET"}, "id": "Zz9Yy8Xx7"}]'
GENERIC_CALL = '{"tool_call": {"name": "get_weather", "arguments": {"location": "Rome"}}}'
GENERIC_CALLS = (
    '{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, 2, {"y": null}]}}]}'
)
GENERIC_RESPONSE = '{"response": "Hello! \\"Quoted\\" and\\nnew line \\u00e9t\\u00e9"}'
FUNCTIONARY_CALL = 'get_weather\n{"location": "Paris"}'
FUNCTIONARY_MIXED = 'all\nLet me look both up.>>>get_weather\n{"location": "Paris"}>>>get_time\n{"tz": "CET"}'
FUNCTIONARY_TEXT = "all\nIt is sunny in Paris.\nEnjoy!"
QWEN3_CODER = (
    'I will check.\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis, "FR"\n</parameter>\n'
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run>\n"
    "<parameter=code>\ndef f(x):\n    return {'a': [x, 1]}\n\nprint(f(2))\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CODER_BARE = "<function=get_time>\n<parameter=tz>\n123\n</parameter>\n</function>\n</tool_call>"
QWEN35_THINK = (
    "Paris first.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n"
    "</parameter>\n</function>\n</tool_call>"
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>commentary"
    ' to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}'
)
HARMONY_ROLE_CALL = '<|channel|>analysis<|message|>Time.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}'
HARMONY_FINAL = (
    "<|channel|>analysis<|message|>Simple: greet.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!"
)
HARMONY_PREAMBLE = (
    "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary"
    ' to=functions.get_weather<|message|>{"location": "Oslo"}'
)
SCHEMA_TOOLS = [
    Tool(
        "get_weather",
        "",
        {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}}},
    ),
    Tool("get_time", "", {"type": "object", "properties": {"tz": {"type": "string"}}}),
    Tool("run", "", {"type": "object", "properties": {"code": {"type": "string"}}}),
]
DS_R1 = (
    "I need the weather.\n</think>\n\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"location": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


def calls(m: ChatMessageOut) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in m.tool_calls]


def stream(text: str, fmt: ToolFormat, seed: int, **kw: object) -> tuple[ChatMessageOut, ChatMessageOut]:
    """Feed `text` in random pieces; returns (the deltas summed, the parser's final message)."""
    rng = random.Random(seed)
    p = ChatStreamParser(fmt, **kw)  # type: ignore[arg-type]
    content, reasoning = "", ""
    args: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    pos = 0
    deltas = []
    while pos < len(text):
        n = rng.randint(1, 7)
        deltas.append(p.feed(text[pos : pos + n]))
        pos += n
    deltas.append(p.finish())
    for d in deltas:
        content += d.content
        reasoning += d.reasoning_content
        for t in d.tool_calls:
            if t.id is not None:
                assert t.index not in ids and t.name
                ids[t.index] = t.id
                args[t.index] = [t.name]
            args[t.index].append(t.arguments)
    summed = ChatMessageOut(content, reasoning)
    for i in sorted(args):
        from ubatch.engine.chat.tools.types import ToolCall

        summed.tool_calls.append(ToolCall(args[i][0], "".join(args[i][1:]), ids[i]))
    return summed, p.message


CASES = [
    (QWEN_ONE, ToolFormat.HERMES, {}, "", [("get_weather", {"location": "Paris, France", "unit": "celsius"})]),
    (
        QWEN_TWO,
        ToolFormat.HERMES,
        {},
        "Let me check both cities.",
        [("get_weather", {"location": "Paris"}), ("get_weather", {"location": 'Tokyo "JP" é'})],
    ),
    (LLAMA3, ToolFormat.LLAMA3, {}, "", [("get_weather", {"location": "San Francisco, CA"})]),
    (LLAMA3_TAG, ToolFormat.LLAMA3, {}, "", [("python", {"code": "print(1 + 1)"})]),
    (NEMO, ToolFormat.MISTRAL_NEMO, {}, "", [("get_weather", {"location": "Paris"}), ("get_time", {"tz": "CET"})]),
    (GENERIC_CALL, ToolFormat.GENERIC, {}, "", [("get_weather", {"location": "Rome"})]),
    (GENERIC_CALLS, ToolFormat.GENERIC, {}, "", [("a", {}), ("b", {"x": [1, 2, {"y": None}]})]),
    (GENERIC_RESPONSE, ToolFormat.GENERIC, {}, 'Hello! "Quoted" and\nnew line été', []),
    (DS_R1, ToolFormat.DEEPSEEK_R1, {"thinking_forced_open": True}, "", [("get_weather", {"location": "Oslo"})]),
    (FUNCTIONARY_CALL, ToolFormat.FUNCTIONARY_V3_2, {}, "", [("get_weather", {"location": "Paris"})]),
    (HARMONY_CALL, ToolFormat.GPT_OSS, {"tools": SCHEMA_TOOLS}, "", [("get_weather", {"location": "Paris"})]),
    (HARMONY_ROLE_CALL, ToolFormat.GPT_OSS, {"tools": SCHEMA_TOOLS}, "", [("get_time", {"tz": "CET"})]),
    (HARMONY_FINAL, ToolFormat.GPT_OSS, {}, "Hello there!", []),
    (
        HARMONY_PREAMBLE,
        ToolFormat.GPT_OSS,
        {"tools": SCHEMA_TOOLS},
        "Let me check.",
        [("get_weather", {"location": "Oslo"})],
    ),
    (
        FUNCTIONARY_MIXED,
        ToolFormat.FUNCTIONARY_V3_2,
        {},
        "Let me look both up.",
        [("get_weather", {"location": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    (FUNCTIONARY_TEXT, ToolFormat.FUNCTIONARY_V3_2, {}, "It is sunny in Paris.\nEnjoy!", []),
    (
        QWEN3_CODER,
        ToolFormat.QWEN3_CODER,
        {"tools": SCHEMA_TOOLS},
        "I will check.",
        [
            ("get_weather", {"location": 'Paris, "FR"', "days": 3}),
            ("run", {"code": "def f(x):\n    return {'a': [x, 1]}\n\nprint(f(2))"}),
        ],
    ),
    (QWEN3_CODER_BARE, ToolFormat.QWEN3_CODER, {"tools": SCHEMA_TOOLS}, "", [("get_time", {"tz": "123"})]),
    (QWEN3_CODER_BARE, ToolFormat.QWEN3_CODER, {}, "", [("get_time", {"tz": 123})]),  # no schema: JSON if it parses
    (
        QWEN35_THINK,
        ToolFormat.QWEN3_CODER,
        {"thinking_forced_open": True, "tools": SCHEMA_TOOLS},
        "",
        [("get_weather", {"location": "Paris"})],
    ),
    ("Just text, no calls at all.", ToolFormat.HERMES, {}, "Just text, no calls at all.", []),
    ("The weather is nice.", ToolFormat.LLAMA3, {}, "The weather is nice.", []),
]


@pytest.mark.parametrize("text,fmt,kw,content,expected", CASES)
def test_whole_and_streamed(text: str, fmt: ToolFormat, kw: dict, content: str, expected: list) -> None:
    m = parse_chat_output(text, fmt, **kw)
    assert m.content == content
    assert calls(m) == expected
    assert m.finish_reason == ("tool_calls" if expected else "stop")
    for seed in range(8):
        summed, final = stream(text, fmt, seed, **kw)
        assert calls(final) == expected and final.content == content
        assert summed.content == final.content and summed.reasoning_content == final.reasoning_content
        assert [(c.id, c.name, c.arguments) for c in summed.tool_calls] == [
            (c.id, c.name, c.arguments) for c in final.tool_calls
        ]


def test_nemo_keeps_the_models_ids() -> None:
    m = parse_chat_output(NEMO, ToolFormat.MISTRAL_NEMO)
    assert [c.id for c in m.tool_calls] == ["a1B2c3D4e", "Zz9Yy8Xx7"]
    assert m.to_openai()["content"] == ""  # llama-server's common_chat_msg JSON: "" with calls, never null


def test_ids_are_fresh_and_openai_shaped() -> None:
    m = parse_chat_output(QWEN_TWO, ToolFormat.HERMES)
    a, b = (c.to_openai() for c in m.tool_calls)
    assert a["id"] != b["id"] and a["type"] == "function"
    assert json.loads(a["function"]["arguments"]) == {"location": "Paris"}  # type: ignore[index]


def test_qwen3_thinking_goes_to_reasoning() -> None:
    m = parse_chat_output(QWEN3_THINK, ToolFormat.HERMES)
    assert m.reasoning_content.startswith("The user wants the weather") and "<tool_call> syntax" in m.reasoning_content
    assert calls(m) == [("get_weather", {"location": "Berlin"})] and m.content == ""
    for seed in range(5):
        summed, final = stream(QWEN3_THINK, ToolFormat.HERMES, seed)
        assert summed.reasoning_content == final.reasoning_content == m.reasoning_content
    none = parse_chat_output(QWEN3_THINK, ToolFormat.HERMES, reasoning_format="none")
    assert none.reasoning_content == "" and none.content.startswith("<think>")


def test_deepseek_r1_reasoning_streams() -> None:
    text = "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is **4**."
    m = parse_chat_output(text, ToolFormat.CONTENT_ONLY, thinking_forced_open=True)
    assert (m.reasoning_content, m.content) == ("Okay, 2 + 2 is 4.", "The answer is **4**.")
    for seed in range(8):
        summed, final = stream(text, ToolFormat.CONTENT_ONLY, seed, thinking_forced_open=True)
        assert (summed.reasoning_content, summed.content) == (m.reasoning_content, m.content)
    # unclosed thinking (cut by n_predict): all of it is reasoning
    assert parse_chat_output("Hmm, let me", thinking_forced_open=True).reasoning_content == "Hmm, let me"
    assert parse_chat_output("<think>a</think>b").reasoning_content == "a"
    assert parse_chat_output("<think>a</think>b", reasoning_format="none").content == "<think>a</think>b"


@pytest.mark.parametrize(
    "text,fmt",
    [
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', ToolFormat.HERMES),  # unbalanced
        ("<tool_call>\nnot json at all\n</tool_call>", ToolFormat.HERMES),
        ("[TOOL_CALLS] sorry, no", ToolFormat.MISTRAL_NEMO),
        ("I think the answer is 42", ToolFormat.GENERIC),  # a model that ignored the JSON wrapper
        ('{"name": 3}', ToolFormat.LLAMA3),
    ],
)
def test_malformed_calls_are_content(text: str, fmt: ToolFormat) -> None:
    m = parse_chat_output(text, fmt)
    assert m.tool_calls == [] and m.content == text


def test_partial_markers_are_held_back() -> None:
    p = ChatStreamParser(ToolFormat.HERMES)
    assert p.feed("Sure. <tool_c").content == "Sure."
    d = p.feed('all>\n{"name": "f", "arguments": {"q": "x')
    assert d.content == "" and d.tool_calls[0].name == "f" and d.tool_calls[0].arguments == '{"q": "x'
    assert p.feed('y"}}\n</tool_call>').tool_calls[0].arguments == 'y"}'
    p.finish()
    assert calls(p.message) == [("f", {"q": "xy"})]


TEMPLATES = Path(__file__).parent / "data" / "templates"  # copied from llama.cpp's models/templates


def test_detect_from_real_templates() -> None:
    t = {f.stem: f.read_text() for f in TEMPLATES.glob("*.jinja")}
    assert detect_tool_format(t["Qwen-Qwen2.5-7B-Instruct"]) is ToolFormat.HERMES
    assert detect_tool_format(t["NousResearch-Hermes-3-Llama-3.1-8B-tool_use"]) is ToolFormat.HERMES
    assert detect_tool_format(t["meta-llama-Llama-3.1-8B-Instruct"]) is ToolFormat.LLAMA3
    assert detect_tool_format(t["meta-llama-Llama-3.3-70B-Instruct"]) is ToolFormat.LLAMA3
    assert detect_tool_format(t["mistralai-Mistral-Nemo-Instruct-2407"]) is ToolFormat.MISTRAL_NEMO
    assert detect_tool_format(t["google-gemma-2-2b-it"]) is ToolFormat.GENERIC
    assert detect_tool_format(t["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"]) is ToolFormat.DEEPSEEK_R1
    assert detect_tool_format(None) is ToolFormat.GENERIC
    assert detect_tool_format(t["meetkai-functionary-medium-v3.2"]) is ToolFormat.FUNCTIONARY_V3_2
    assert detect_tool_format(t["Qwen3-Coder"]) is ToolFormat.QWEN3_CODER
    assert detect_tool_format(t["Qwen3.5-4B"]) is ToolFormat.QWEN3_CODER
    assert detect_tool_format(t["Qwen-Qwen3-0.6B"]) is ToolFormat.HERMES
    assert detect_tool_format(t["openai-gpt-oss-120b"]) is ToolFormat.GPT_OSS


def test_functionary_and_qwen3_coder_malformed_and_cut() -> None:
    # a model that wrote plain lines is content; so is one that never finished its recipient
    for text in ("Hello there\nHow are you?", "Sure thing"):
        assert parse_chat_output(text, ToolFormat.FUNCTIONARY_V3_2).content == text
    # a string parameter streams as it is written; a number waits until it is whole
    p = ChatStreamParser(ToolFormat.QWEN3_CODER, tools=SCHEMA_TOOLS)
    d = p.feed("<tool_call>\n<function=get_weather>\n<parameter=location>\nPar")
    assert (d.tool_calls[0].name, d.tool_calls[0].arguments) == ("get_weather", '{"location": "Par')
    assert p.feed("is\n").tool_calls[0].arguments == "is"  # the newline may end the value: held back
    assert p.feed("</parameter>\n<parameter=days>\n1").tool_calls[0].arguments == '"'
    assert p.feed("2\n</parameter>\n</function>").tool_calls[0].arguments == ', "days": 12}'
    p.finish()
    assert calls(p.message) == [("get_weather", {"location": "Paris", "days": 12})]
    # cut inside the value: the call as far as it went
    cut = parse_chat_output(QWEN3_CODER[: QWEN3_CODER.index("Par") + 3], ToolFormat.QWEN3_CODER, tools=SCHEMA_TOOLS)
    assert cut.content == "I will check." and [(c.name, c.arguments) for c in cut.tool_calls] == [
        ("get_weather", '{"location": "Par')
    ]


def test_generic_call_cut_by_the_end_of_generation() -> None:
    """n_predict ends the answer inside the arguments: the final message keeps the call with the
    arguments written so far (llama.cpp's lenient parse), as the stream already showed it, and
    sends nothing more as content."""
    cut = GENERIC_CALL[:-7]  # '{"tool_call": {"name": "get_weather", "arguments": {"location": "R'
    m = parse_chat_output(cut, ToolFormat.GENERIC)
    assert m.content == "" and [(c.name, c.arguments) for c in m.tool_calls] == [("get_weather", '{"location": "R')]
    for seed in range(8):
        summed, final = stream(cut, ToolFormat.GENERIC, seed)
        assert summed.content == final.content == ""
        assert [(c.name, c.arguments) for c in summed.tool_calls] == [(c.name, c.arguments) for c in final.tool_calls]
    # a response cut short is the text so far; a call whose name never finished is the raw text
    assert parse_chat_output(GENERIC_RESPONSE[:20], ToolFormat.GENERIC).content == "Hello!"
    head = '{"tool_call": {"name": "get_w'
    assert parse_chat_output(head, ToolFormat.GENERIC).content == head


@pytest.mark.parametrize("text,fmt,kw", [(t, f, k) for t, f, k, _, _ in CASES])
def test_every_cut_streams_what_it_parses_to(text: str, fmt: ToolFormat, kw: dict) -> None:
    """Wherever generation stops, the streamed deltas add up to the final message: nothing the
    stream sent as a call comes back as content."""
    for n in range(1, len(text) + 1):
        cut = text[:n]
        whole = parse_chat_output(cut, fmt, **kw)
        summed, final = stream(cut, fmt, n, **kw)
        assert (summed.content, summed.reasoning_content) == (final.content, final.reasoning_content), cut
        assert (final.content, final.reasoning_content) == (whole.content, whole.reasoning_content), cut
        got = [(c.name, c.arguments) for c in summed.tool_calls]
        assert (
            got
            == [(c.name, c.arguments) for c in final.tool_calls]
            == [(c.name, c.arguments) for c in whole.tool_calls]
        ), cut


def test_harmony_channels() -> None:
    """GPT-OSS: analysis is the reasoning (several blocks join), a call to a tool not offered
    is dropped (a built-in tool's, or any with tool_choice none), reasoning_format none keeps
    the analysis in the content as written, text that is not harmony is content."""
    m = parse_chat_output(HARMONY_CALL, ToolFormat.GPT_OSS, tools=SCHEMA_TOOLS)
    assert m.reasoning_content == "I need the weather."
    two = "<|channel|>analysis<|message|>One. <|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
    assert (
        parse_chat_output(
            two + HARMONY_FINAL[len("<|channel|>analysis<|message|>Simple: greet.<|end|>") :], ToolFormat.GPT_OSS
        ).reasoning_content
        == "One. Two."
    )
    assert parse_chat_output(HARMONY_CALL, ToolFormat.GPT_OSS).tool_calls == []  # nothing offered
    browse = '<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=browser.search<|message|>{"q": 1}'
    assert parse_chat_output(browse, ToolFormat.GPT_OSS, tools=SCHEMA_TOOLS).tool_calls == []
    none = parse_chat_output(HARMONY_FINAL, ToolFormat.GPT_OSS, reasoning_format="none")
    assert (
        none.reasoning_content == ""
        and none.content == "<|channel|>analysis<|message|>Simple: greet.<|end|>Hello there!"
    )
    assert parse_chat_output("Just words.", ToolFormat.GPT_OSS).content == "Just words."
    for seed in range(6):
        summed, final = stream(HARMONY_FINAL, ToolFormat.GPT_OSS, seed)
        assert (
            (summed.reasoning_content, summed.content)
            == ("Simple: greet.", "Hello there!")
            == (final.reasoning_content, final.content)
        )
