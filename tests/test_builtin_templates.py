"""Every llama.cpp built-in chat format against llama.cpp itself: the expected strings are facts
from llama.cpp (tests/data/llama_chat_templates.json says where each comes from): its own test
cases (tests/test-chat-template.cpp: a template source, the format its detection picks and the
text llm_chat_apply_template writes), and what its llama_chat_apply_template wrote for each
name, conversation and add_generation_prompt, and for a source that reaches each detection
branch the upstream cases miss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ubatch.engine.chat.formats import BUILTIN, NAMED, Turn
from ubatch.engine.chat.template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    ChatTemplateError,
    apply_chat_template,
    detect_template,
    load_template,
)

DATA: dict[str, Any] = json.loads((Path(__file__).parent / "data" / "llama_chat_templates.json").read_text("utf-8"))
CONVERSATIONS: dict[str, list[Turn]] = {k: [(r, c) for r, c in v] for k, v in DATA["conversations"].items()}


def test_the_names_are_llama_cpps() -> None:
    assert sorted(BUILTIN_TEMPLATES) == sorted(DATA["names"]) == sorted(NAMED)
    for name in BUILTIN_TEMPLATES:
        assert load_template(name) == name
        assert detect_template(name, "llama") == name  # an exact name wins over every heuristic


@pytest.mark.parametrize("case", DATA["test_chat_template_cpp"], ids=lambda c: c["format"] + ": " + c["name"][:40])
def test_llama_cpp_test_cases(case: dict[str, Any]) -> None:
    """Detection and rendering of upstream's own cases, with its conversation and add_ass true."""
    assert detect_template(case["template"], "llama") == case["format"]
    turns = CONVERSATIONS["test_chat_template_cpp"] + [(r, c) for r, c in case["extra_conversation"]]
    assert BUILTIN[case["format"]](turns, True) == case["expected"]


@pytest.mark.parametrize(
    "r",
    DATA["renders"],
    ids=lambda r: f"{r['template']}-{r['conversation']}-{'gen' if r['add_generation_prompt'] else 'nogen'}",
)
def test_renders_as_libllama(r: dict[str, Any]) -> None:
    """Each name (and dots1, which only detection reaches) on a plain conversation (system, user,
    assistant, user), one with padded contents and a tool turn, and one without a system turn."""
    name = detect_template(r["template"], "llama")
    assert BUILTIN[name](CONVERSATIONS[r["conversation"]], r["add_generation_prompt"]) == r["expected"]


@pytest.mark.parametrize("d", DATA["detection"], ids=lambda d: str(d["format"]))
def test_detection_branches(d: dict[str, Any]) -> None:
    """A source per detection branch: the format llama.cpp picks, and the text it writes with it
    (None: llama.cpp knows no format for it; ours is then rendered as Jinja)."""
    got = detect_template(d["template"], "llama")
    if d["format"] is None:
        assert got == "jinja" and d["expected"] is None
    else:
        assert got == d["format"]
        assert BUILTIN[got](CONVERSATIONS["plain"], True) == d["expected"]


def test_through_apply_chat_template_and_no_jinja() -> None:
    """The names render through the public entry points: apply_chat_template, --chat-template
    NAME, and --no-jinja with a GGUF template llama.cpp detects."""
    msgs = [{"role": r, "content": c} for r, c in CONVERSATIONS["plain"]]
    for name in ("llama2-sys", "mistral-v7", "phi4", "deepseek3", "kimi-k2"):
        want = BUILTIN[name](CONVERSATIONS["plain"], True)
        assert apply_chat_template(msgs, name) == want
        t = ChatTemplate.from_metadata({}, "llama", override=name)
        assert (t.name, t.source) == (name, None) and t.apply(msgs) == want
    phi4 = next(c for c in DATA["test_chat_template_cpp"] if c["format"] == "phi4")
    t = ChatTemplate.from_metadata({"tokenizer.chat_template": phi4["template"]}, "llama", use_jinja=False)
    assert (t.name, t.source) == ("phi4", None)
    assert t.apply(msgs) == BUILTIN["phi4"](CONVERSATIONS["plain"], True)


def test_dots1_is_detected_but_not_a_name() -> None:
    """llama.cpp's table has no 'dots1': --chat-template dots1 is not a built-in there either."""
    assert "dots1" in BUILTIN and "dots1" not in BUILTIN_TEMPLATES
    with pytest.raises(ChatTemplateError, match="unknown chat template"):
        load_template("dots1")


def test_c_semantics_of_case_and_space() -> None:
    """C's toupper and isspace: only ASCII letters change case, only C spaces are trimmed."""
    turns: list[Turn] = [("système", "x"), ("user", "\u00a0y\u00a0 ")]
    assert BUILTIN["bailing"](turns, False) == "<role>SYSTèME</role>x<role>HUMAN</role>\u00a0y\u00a0 "
    assert BUILTIN["llama3"](turns, False).endswith(
        "<|start_header_id|>user<|end_header_id|>\n\n\u00a0y\u00a0<|eot_id|>"
    )
    assert BUILTIN["openchat"]([("émile", "z")], False) == "GPT4 Correct émile: z<|end_of_turn|>"
