"""The parsers of the formats that are not a JSON call object: Functionary v3.2's recipients
(`>>>name` then the arguments) and Qwen3-Coder's XML (`<function=name>` with one
`<parameter=key>` per argument), whole or as they stream (engine/chat/tools/parse.py's rules:
a partial parse is a prefix of the whole one, and the end of generation inside a call keeps it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from ubatch.engine.chat.tools.calls import CutShort, Malformed, RawCall, cut_partial_marker, expect
from ubatch.engine.chat.tools.jsonscan import scan_value, skip_ws
from ubatch.engine.chat.tools.types import Tool

Parsed = tuple[str, list[RawCall]]

# -- Functionary v3.2 ---------------------------------------------------------------------------

RECIPIENT = ">>>"  # the prompt ends with it; the model writes "all" (text) or a function's name
ALL = "all"


def functionary_v3_2(text: str, partial: bool) -> Parsed:
    """`all\\ntext` and `name\\n{arguments}` segments, each after `>>>` (the first one's is the
    prompt's). Text that follows the calls is dropped, as after Hermes calls."""
    content: list[str] = []
    calls: list[RawCall] = []
    pos = 0
    while True:
        nl = text.find("\n", pos)
        if nl < 0:  # the recipient is still being written
            head = text[pos:].strip()
            if partial or head in ("", ALL):
                return "".join(content), calls
            raise CutShort
        recipient = text[pos:nl].strip()
        if recipient == ALL:
            end = text.find(RECIPIENT, nl + 1)
            if end < 0:
                body = text[nl + 1 :]
                content.append(cut_partial_marker(body, (RECIPIENT,)) if partial else body)
                return "".join(content), calls
            content.append(text[nl + 1 : end])
            pos = end + len(RECIPIENT)
            continue
        if not recipient or any(c.isspace() or c in "{}<>" for c in recipient):
            raise Malformed  # not a function's name: a model that did not follow the format
        start = skip_ws(text, nl + 1)
        v = scan_value(text, start)
        if not v.ok or (start < len(text) and text[start] != "{"):
            raise Malformed
        if not v.complete:
            if not partial:
                raise CutShort
            calls.append(RawCall(recipient, text[start:].rstrip()))
            return "".join(content), calls
        calls.append(RawCall(recipient, text[start : v.end]))
        pos = skip_ws(text, v.end)
        after = expect(text, pos, RECIPIENT)
        if after is None or after < 0:  # the end, a `>>>` cut short, or trailing text
            return "".join(content), calls
        pos = after


# -- Qwen3-Coder ----------------------------------------------------------------------------------

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"

# how a parameter's value is read: as text, as JSON, or JSON when it parses (else text)
STRING, JSON, EITHER = "string", "json", "either"
ParamKinds = Mapping[str, Mapping[str, str]]  # tool -> parameter -> kind


def param_kind(schema: object) -> str:
    """A parameter's kind from its JSON schema, as llama.cpp's parser types values."""
    if not isinstance(schema, Mapping):
        return EITHER
    t = schema.get("type")
    types = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else set()
    if types == {"string"}:
        return STRING
    if types and "string" not in types:
        return JSON
    return EITHER


def param_kinds(tools: Sequence[Tool]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for t in tools:
        props = t.parameters.get("properties")
        if isinstance(props, Mapping):
            out[t.name] = {str(k): param_kind(v) for k, v in props.items()}
    return out


def _value(kind: str, raw: str) -> str:
    """A whole parameter value as JSON text: text as a string; JSON kept as written."""
    if kind != STRING:
        try:
            v = json.loads(raw)
        except ValueError:
            v = None
        else:
            if not isinstance(v, str):
                return raw.strip()
    return json.dumps(raw, ensure_ascii=False)


def _args(done: list[tuple[str, str]], open_key: str | None, open_text: str, closed: bool) -> str:
    """The arguments' JSON text: whole values, then a string value still being written (its
    closing quote and the brace come when they are known)."""
    items = [f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in done]
    if open_key is not None:
        items.append(f"{json.dumps(open_key, ensure_ascii=False)}: " + json.dumps(open_text, ensure_ascii=False)[:-1])
    return "{" + ", ".join(items) + ("}" if closed else "")


def qwen3_coder(text: str, partial: bool, kinds: ParamKinds | None = None) -> Parsed:
    """Content, then calls: `<tool_call>` (Qwen3-Coder sometimes leaves it out), `<function=name>`,
    its parameters, `</function>`, `</tool_call>`. Each value is read by its parameter's kind
    (`kinds`, from the request's tools); a string value streams as it is written."""
    starts = (CALL_OPEN, FUNCTION_OPEN)
    hits = [i for i in (text.find(s) for s in starts) if i >= 0]
    if not hits:
        return (cut_partial_marker(text, starts) if partial else text), []
    content, pos = text[: min(hits)], min(hits)
    calls: list[RawCall] = []
    kinds = kinds or {}

    def cut() -> Parsed:
        if not partial:
            raise CutShort
        return content, calls

    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return content, calls
        opened = expect(text, pos, CALL_OPEN)
        if opened is not None:
            if opened < 0:
                return content, calls  # `<tool_call>` cut short: nothing shown of it yet
            pos = skip_ws(text, opened)
        name_at = expect(text, pos, FUNCTION_OPEN)
        if name_at is None:
            if pos >= len(text):
                return content, calls
            if opened is None:
                return content, calls  # trailing text after the calls is dropped
            raise Malformed
        if name_at < 0:
            return cut()
        gt = text.find(">", name_at)
        if gt < 0:
            return cut()
        name = text[name_at:gt].strip()
        call_kinds = kinds.get(name, {})
        done: list[tuple[str, str]] = []
        pos = gt + 1
        while True:
            pos = skip_ws(text, pos)
            closing = expect(text, pos, FUNCTION_CLOSE)
            if closing is not None and closing > 0:
                calls.append(RawCall(name, _args(done, None, "", True)))
                pos = closing
                break
            key_at = expect(text, pos, PARAM_OPEN)
            if key_at is None and closing is None:
                if pos >= len(text):
                    calls.append(RawCall(name, _args(done, None, "", False)))
                    return cut()
                raise Malformed
            if key_at is None or key_at < 0:  # `</function>` or `<parameter=` cut short
                calls.append(RawCall(name, _args(done, None, "", False)))
                return cut()
            gt = text.find(">", key_at)
            if gt < 0:
                calls.append(RawCall(name, _args(done, None, "", False)))
                return cut()
            key = text[key_at:gt].strip()
            kind = call_kinds.get(key, EITHER)
            start = gt + 1
            if text.startswith("\n", start):
                start += 1
            end = text.find(PARAM_CLOSE, start)
            if end < 0:  # the value is still being written: a string shows what is sure of it
                so_far = cut_partial_marker(text[start:], ("\n" + PARAM_CLOSE,))
                shown = kind == STRING and start < len(text)
                calls.append(RawCall(name, _args(done, key if shown else None, so_far, False)))
                return cut()
            raw = text[start:end]
            done.append((key, _value(kind, raw[:-1] if raw.endswith("\n") else raw)))
            pos = end + len(PARAM_CLOSE)
        pos = skip_ws(text, pos)
        closed = expect(text, pos, CALL_CLOSE)
        if closed is not None:
            if closed < 0:
                return content, calls
            pos = closed
