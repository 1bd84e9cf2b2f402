"""The grammar a tool request generates under, per format (llama.cpp's common_chat_params_init_*).

With `tool_choice` required or a named function the whole answer must be calls (after an
optional thinking block); with auto the grammar is lazy: the text is free until the format's
trigger (`<tool_call>`, `[TOOL_CALLS]`, a leading `{"name": "`...) and constrained from the
trigger's start to the end of the calls. The generic format is never lazy: its answer is always
one JSON object, a call or `{"response": "..."}`. Each tool's arguments follow its JSON schema,
converted by engine/grammar/json_schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ubatch.engine.chat.tools import formats as F
from ubatch.engine.chat.tools.formats import ToolFormat
from ubatch.engine.chat.tools.parse import HERMES_CLOSE, HERMES_OPEN, MISTRAL_TAG, PYTHON_TAG, THINK_CLOSE, THINK_OPEN
from ubatch.engine.chat.tools.request import ToolRequestError
from ubatch.engine.chat.tools.types import Tool, ToolChoice
from ubatch.engine.grammar import Grammar, compile_grammar
from ubatch.engine.grammar.json_schema.convert import Converter
from ubatch.engine.grammar.json_schema.nodes import SchemaError
from ubatch.engine.grammar.json_schema.read import read_schema
from ubatch.engine.grammar.json_schema.rules import format_literal


@dataclass(frozen=True, slots=True)
class ToolGrammar:
    """GBNF text and, for a lazy grammar, what engages it: trigger words (anywhere in the text)
    and patterns (regexes searched from the text's start; group 1, or the match, is where the
    constrained part begins)."""

    gbnf: str
    lazy: bool = False
    trigger_words: tuple[str, ...] = ()
    trigger_patterns: tuple[str, ...] = ()

    def compile(self, tokenize: Callable[[str], list[int]] | None = None) -> Grammar:
        grammar = compile_grammar(self.gbnf, tokenize)
        if self.lazy:
            return grammar.with_triggers(self.trigger_words, self.trigger_patterns)
        return grammar


def _lit(s: str) -> str:
    return format_literal(s)


def _key(name: str) -> str:
    return _lit(json.dumps(name)) + " space " + _lit(":") + " space"


class _Builder:
    def __init__(self) -> None:
        self.conv = Converter()

    def args_rule(self, tool: Tool) -> str:
        try:
            rule = self.conv.visit(read_schema(tool.parameters), tool.name + "-args")
        except SchemaError as e:
            raise ToolRequestError(f"tool {tool.name!r}: {e}") from None
        if self.conv.errors:
            raise ToolRequestError(f"tool {tool.name!r}: " + "; ".join(self.conv.errors))
        return rule

    def call_object(self, tool: Tool, name_key: str, args_key: str, with_id: bool = False) -> str:
        parts = [
            _lit("{"),
            "space",
            _key(name_key),
            _lit(json.dumps(tool.name)),
            "space",
            _lit(","),
            "space",
            _key(args_key),
            self.args_rule(tool),
        ]
        if with_id:
            parts += [_lit(","), "space", _key("id"), _lit('"'), "[a-zA-Z0-9]{9}", _lit('"'), "space"]
        parts += [_lit("}"), "space"]
        return self.conv.add_rule(tool.name + "-call", " ".join(parts))

    def rule(self, name: str, body: str) -> str:
        return self.conv.add_rule(name, body)

    def text(self, root: str) -> str:
        self.conv.rules["root"] = root
        return self.conv.grammar()


def _one_of(rules: list[str]) -> str:
    return "( " + " | ".join(rules) + " )"


def _repeat(item: str, parallel: bool, sep: str = "space") -> str:
    return f"{item} ( {sep} {item} )*" if parallel else item


def _think_rule(b: _Builder, forced_open: bool) -> str:
    """A thinking block: any text without `</think>`, then `</think>` (opened by the prompt
    when forced open)."""
    close = THINK_CLOSE
    alts = ["[^" + close[0] + "]"] + [_lit(close[:i]) + " [^" + close[i] + "]" for i in range(1, len(close))]
    body = b.rule("think-text", "( " + " | ".join(alts) + " )*")
    open_ = "" if forced_open else _lit(THINK_OPEN) + " "
    return b.rule("think", f"{open_}{body} {_lit(close)} space")


def build_tool_grammar(
    tools: Sequence[Tool],
    choice: ToolChoice,
    fmt: ToolFormat,
    *,
    parallel: bool = False,
    thinking: bool = False,
    thinking_forced_open: bool = False,
) -> ToolGrammar | None:
    """The grammar for a request's tools, or None (no tools, tool_choice none)."""
    if not tools or choice.mode == "none" or fmt is ToolFormat.CONTENT_ONLY:
        return None
    if choice.name is not None:
        tools = [t for t in tools if t.name == choice.name]
        if not tools:
            raise ToolRequestError(f"tool_choice names {choice.name!r}, which is not among the tools")
    required = choice.mode == "required"
    b = _Builder()
    if fmt is ToolFormat.GENERIC:
        calls = b.rule("tool-call", _one_of([b.call_object(t, "name", "arguments") for t in tools]))
        if parallel:
            arr = f"{_lit('[')} space {calls} ( {_lit(',')} space {calls} )* {_lit(']')} space"
            call_alt = f"{_lit('{')} space {_key('tool_calls')} {arr} {_lit('}')} space"
        else:
            call_alt = f"{_lit('{')} space {_key('tool_call')} {calls} {_lit('}')} space"
        alts = [call_alt]
        if not required:
            resp = b.conv.visit(read_schema({"type": "string"}), "response")
            alts.append(f"{_lit('{')} space {_key('response')} {resp} {_lit('}')} space")
        return ToolGrammar(b.text(_with_think(b, " | ".join(alts), thinking, thinking_forced_open)))

    words: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    if fmt is ToolFormat.HERMES:
        obj = b.rule("tool-call-object", _one_of([b.call_object(t, "name", "arguments") for t in tools]))
        call = b.rule("tool-call", f"{_lit(HERMES_OPEN)} space {obj} {_lit(HERMES_CLOSE)}")
        body = _repeat(call, parallel) + " space"
        words = (HERMES_OPEN,)
    elif fmt is ToolFormat.LLAMA3:
        obj = b.rule("tool-call", _one_of([b.call_object(t, "name", "parameters") for t in tools]))
        body = f"( {_lit(PYTHON_TAG)} space )? {obj}"
        words = (PYTHON_TAG,)
        patterns = (r'^\s*(\{\s*"name"\s*:\s*")',)
    elif fmt is ToolFormat.MISTRAL_NEMO:
        obj = b.rule("tool-call", _one_of([b.call_object(t, "name", "arguments", with_id=True) for t in tools]))
        items = f"{obj} ( {_lit(',')} space {obj} )*" if parallel else obj
        body = f"{_lit(MISTRAL_TAG)} space {_lit('[')} space {items} {_lit(']')} space"
        words = (MISTRAL_TAG,)
    elif fmt is ToolFormat.DEEPSEEK_R1:
        alts = []
        for t in tools:
            head = f"{F.DS_CALL_BEGIN}function{F.DS_SEP}{t.name}\n```json\n"
            alts.append(f"{_lit(head)} {b.args_rule(t)} {_lit(chr(10) + '```' + F.DS_CALL_END)}")
        call = b.rule("tool-call", _one_of(alts))
        body = f"{_lit(F.DS_CALLS_BEGIN)} {_repeat(call, parallel, '')} {_lit(F.DS_CALLS_END)} space"
        words = (F.DS_CALLS_BEGIN,)
    else:
        raise ToolRequestError(f"no tool grammar for the {fmt.value} format")
    if required:
        return ToolGrammar(b.text(_with_think(b, body, thinking, thinking_forced_open)))
    if thinking:  # a trigger inside the thinking block is not a call: look only after it
        words, patterns = (), _after_thinking(words, patterns, thinking_forced_open)
    return ToolGrammar(b.text(body), lazy=True, trigger_words=words, trigger_patterns=patterns)


def _with_think(b: _Builder, body: str, thinking: bool, forced_open: bool) -> str:
    if not thinking:
        return body
    think = _think_rule(b, forced_open)
    return f"{think} ( {body} )" if forced_open else f"{think}? ( {body} )"


def _after_thinking(words: tuple[str, ...], patterns: tuple[str, ...], forced_open: bool) -> tuple[str, ...]:
    """The triggers as patterns that skip a leading thinking block."""
    head = (
        r"^[\s\S]*?" + re.escape(THINK_CLOSE)
        if forced_open
        else r"^(?:\s*"
        + re.escape(THINK_OPEN)
        + r"[\s\S]*?"
        + re.escape(THINK_CLOSE)
        + r"|(?!\s*"
        + re.escape(THINK_OPEN)
        + "))"
    )
    out = [head + r"[\s\S]*?(" + re.escape(w) + ")" for w in words]
    for p in patterns:  # a pattern anchored at the start: anchored after the thinking block
        out.append(head + p.removeprefix("^"))
    return tuple(out)
