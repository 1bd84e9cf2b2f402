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
from ubatch.engine.chat.tools import harmony as H
from ubatch.engine.chat.tools import parse_tagged as T
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


def _not(c: str) -> str:
    """A character class of everything but `c`."""
    esc = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\", "]": "\\]", "^": "\\^", "-": "\\-"}
    return "[^" + esc.get(c, c) + "]"


def _until(b: _Builder, name: str, close: str) -> str:
    """Text that does not contain `close` (what comes before it)."""
    alts = [_not(close[0])] + [_lit(close[:i]) + " " + _not(close[i]) for i in range(1, len(close))]
    return b.rule(name, "( " + " | ".join(alts) + " )*")


def _think_rule(b: _Builder, forced_open: bool) -> str:
    """A thinking block: any text without `</think>`, then `</think>` (opened by the prompt
    when forced open)."""
    body = _until(b, "think-text", THINK_CLOSE)
    open_ = "" if forced_open else _lit(THINK_OPEN) + " "
    return b.rule("think", f"{open_}{body} {_lit(THINK_CLOSE)} space")


def _functionary(b: _Builder, tools: Sequence[Tool], parallel: bool, required: bool) -> tuple[str, tuple[str, ...]]:
    """`name\n{arguments}` after the prompt's `>>>`, more calls each after `>>>`; a required call may
    follow a text segment (`all\n...`). Lazily: the first line naming something but `all`, or a
    later `>>>` not followed by `all`, engages the grammar."""
    call = b.rule("tool-call", _one_of([f"{_lit(t.name + chr(10))} {b.args_rule(t)}" for t in tools]))
    calls = f"{call} ( {_lit(T.RECIPIENT)} {call} )*" if parallel else call
    if required:
        text = _until(b, "content-text", T.RECIPIENT)
        return f"( {_lit(T.ALL + chr(10))} {text} {_lit(T.RECIPIENT)} )? {calls}", ()
    return f"( {_lit(T.RECIPIENT)} )? {calls}", (">>>(?!all)", r"^(?!all\n)[^\n]*\n")


def _harmony(b: _Builder, tools: Sequence[Tool], required: bool) -> tuple[str, tuple[str, ...]]:
    """GPT-OSS: a message to `functions.NAME` (named in the channel's header or, before it, in the
    role's) with a content type, then the JSON arguments; a required call may follow analysis
    and preamble messages. Lazily: a recipient right after the prompt, or after a later
    `<|start|>assistant`, engages it."""
    kinds = f"( {_lit('commentary')} | {_lit('analysis')} )"
    channel = b.rule("harmony-channel", f"{_lit(H.CHANNEL)} {kinds}")
    constraint = b.rule("harmony-constraint", f"( [ \\t\\n]* {_lit(H.CONSTRAIN)}? [A-Za-z0-9_-]+ )?")
    alts = []
    for t in tools:
        to = _lit(" to=functions." + t.name)
        alts.append(f"( {channel} {to} | {to} {channel} ) {constraint} {_lit(H.MESSAGE)} {b.args_rule(t)}")
    call = b.rule("tool-call", _one_of(alts))
    if required:
        text = _until(b, "message-text", H.END)
        message = b.rule("message", f"{channel} {_lit(H.MESSAGE)} {text} {_lit(H.END)} {_lit(H.START)}")
        return f"{message}* {call}", ()
    patterns = (
        r"^(\s+to=)",
        r"^(<\|channel\|>(?:commentary|analysis)\s+to=)",
        r"<\|start\|>assistant(\s+to=)",
        r"<\|start\|>assistant(<\|channel\|>(?:commentary|analysis)\s+to=)",
    )
    return call, patterns


def _qwen3_coder(b: _Builder, tools: Sequence[Tool], parallel: bool, bare_first: bool) -> str:
    """`<tool_call>\n<function=name>\n`, each parameter as `<parameter=key>\nvalue\n</parameter>\n`
    (a string as text, anything else as JSON of its schema), `</function>\n</tool_call>`. The
    parameters come in the schema's order, each once, the optional ones optional (llama.cpp takes
    the required ones in any order and repeats optional ones at will, which lets a model loop).
    `bare_first`: the first call may leave out `<tool_call>` (Qwen3-Coder)."""
    close = "\n" + T.PARAM_CLOSE + "\n"
    funcs = []
    for t in tools:
        props = t.parameters.get("properties")
        props = props if isinstance(props, dict) else {}
        req = t.parameters.get("required")
        required = {k for k in props if isinstance(req, list) and k in req}
        params: dict[str, str] = {}
        for key, schema in props.items():
            head = _lit(f"{T.PARAM_OPEN}{key}>\n")
            if T.param_kind(schema) == T.JSON:
                try:
                    value = b.conv.visit(read_schema(schema), f"{t.name}-arg-{key}")
                except SchemaError as e:
                    raise ToolRequestError(f"tool {t.name!r}: {e}") from None
            else:
                value = _until(b, "xml-arg-string", close)
            params[key] = b.rule(f"{t.name}-param-{key}", f"{head} {value} {_lit(close)}")
        if b.conv.errors:
            raise ToolRequestError(f"tool {t.name!r}: " + "; ".join(b.conv.errors))
        parts = [params[k] if k in required else params[k] + "?" for k in props]
        body = " ".join([_lit(f"{T.FUNCTION_OPEN}{t.name}>\n"), *parts, _lit(T.FUNCTION_CLOSE + "\n")])
        funcs.append(b.rule(f"{t.name}-function", body))
    func = b.rule("tool-function", _one_of(funcs))
    tail = f"{func} {_lit(T.CALL_CLOSE)} space"
    call = b.rule("tool-call", f"{_lit(T.CALL_OPEN + chr(10))} {tail}")
    first = b.rule("tool-call-first", f"( {_lit(T.CALL_OPEN + chr(10))} )? {tail}") if bare_first else call
    return f"{first} ( {call} )*" if parallel else first


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
    elif fmt is ToolFormat.FUNCTIONARY_V3_2:
        body, patterns = _functionary(b, tools, parallel, required)
    elif fmt is ToolFormat.GPT_OSS:
        body, patterns = _harmony(b, tools, required)
    elif fmt is ToolFormat.QWEN3_CODER:
        body = _qwen3_coder(b, tools, parallel, bare_first=not thinking)
        words = (T.CALL_OPEN,) if thinking else (T.CALL_OPEN, *(f"{T.FUNCTION_OPEN}{t.name}>" for t in tools))
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
