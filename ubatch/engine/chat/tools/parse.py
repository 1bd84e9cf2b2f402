"""The model's text -> content, reasoning and tool calls, per format (llama.cpp's chat parser).

Every parser also reads text cut short (`partial=True`, a stream mid-way): markers that may be
the start of a tag are held back, a call appears once its name is whole, and its arguments are
the JSON text written so far. Whatever a partial parse returns is a prefix of what the whole
text parses to (the stream's deltas rely on it). A call that is not well-formed makes the whole
answer content, as llama.cpp falls back. A whole text that ends inside a call (generation cut by
n_predict) keeps it as far as it goes, arguments and all, as llama.cpp's lenient parse does:
the final message is what the stream already showed, never the calls taken back as content.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial as partial_fn

from ubatch.engine.chat.tools import formats as F
from ubatch.engine.chat.tools.calls import CutShort, Malformed, RawCall, cut_partial_marker, expect
from ubatch.engine.chat.tools.formats import ToolFormat
from ubatch.engine.chat.tools.harmony import Harmony, parse_harmony
from ubatch.engine.chat.tools.jsonscan import partial_string, scan_value, skip_ws
from ubatch.engine.chat.tools.parse_tagged import functionary_v3_2, param_kinds, qwen3_coder
from ubatch.engine.chat.tools.types import ChatMessageOut, Tool, ToolCall, new_call_id

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


# -- reasoning --------------------------------------------------------------------------------


def split_reasoning(text: str, forced_open: bool, partial: bool) -> tuple[str, str, bool]:
    """(reasoning, rest, still_thinking): a leading `<think>...</think>` block (or, when the
    prompt opened one, everything up to `</think>`) taken out of the text."""
    start = 0
    if not forced_open:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            if partial and stripped and THINK_OPEN.startswith(stripped):
                return "", "", True  # may still become a thinking block
            return "", text, False
        start = len(text) - len(stripped) + len(THINK_OPEN)
    end = text.find(THINK_CLOSE, start)
    if end < 0:
        body = text[start:]
        if partial:
            return cut_partial_marker(body, (THINK_CLOSE,)).strip(), "", True
        return body.strip(), "", False
    return text[start:end].strip(), text[end + len(THINK_CLOSE) :].lstrip(), False


# -- one call object: {"name": ..., "arguments": ..., "id": ...} --------------------------------


@dataclass(slots=True)
class _Obj:
    call: RawCall | None  # None: no name yet
    end: int  # just past the object (complete) or len(text)
    complete: bool


def scan_call_object(
    text: str, pos: int, name_keys: tuple[str, ...] = ("name",), args_keys: tuple[str, ...] = ("arguments",)
) -> _Obj:
    """Read a call object at `pos` (raises Malformed); partial objects give what is whole."""
    n = len(text)
    if pos >= n:
        return _Obj(None, n, False)
    if text[pos] != "{":
        raise Malformed
    pos += 1
    name: str | None = None
    args: str | None = None
    call_id: str | None = None
    first = True

    def result(complete: bool, end: int) -> _Obj:
        if name is None:
            if complete:
                raise Malformed
            return _Obj(None, end, False)
        if complete and args is None:
            return _Obj(RawCall(name, "{}", call_id), end, True)
        return _Obj(RawCall(name, args or "", call_id), end, complete)

    while True:
        pos = skip_ws(text, pos)
        if pos >= n:
            return result(False, n)
        if text[pos] == "}" and first:
            return result(True, pos + 1)
        key = partial_string(text, pos)
        if key is None:
            raise Malformed
        k, closed = key
        if not closed:
            return result(False, n)
        pos = skip_ws(text, scan_value(text, pos).end)
        if pos >= n:
            return result(False, n)
        if text[pos] != ":":
            raise Malformed
        pos = skip_ws(text, pos + 1)
        if pos >= n:
            return result(False, n)
        if k in name_keys or k == "id":
            s = partial_string(text, pos)
            if s is None:
                raise Malformed
            if not s[1]:
                return result(False, n)
            if k == "id":
                call_id = s[0]
            else:
                name = s[0]
            pos = scan_value(text, pos).end
        else:
            v = scan_value(text, pos)
            if not v.ok:
                raise Malformed
            if k in args_keys:
                if not v.complete:
                    args = text[pos:].rstrip()
                    return result(False, n)
                args = text[pos : v.end]
            elif not v.complete:
                return result(False, n)
            pos = v.end
        first = False
        pos = skip_ws(text, pos)
        if pos >= n:
            return result(False, n)
        if text[pos] == "}":
            return result(True, pos + 1)
        if text[pos] != ",":
            raise Malformed
        pos += 1


# -- the formats ------------------------------------------------------------------------------

Parsed = tuple[str, list[RawCall]]


def _hermes(text: str, partial: bool) -> Parsed:
    i = text.find(HERMES_OPEN)
    if i < 0:
        return (cut_partial_marker(text, (HERMES_OPEN,)) if partial else text), []
    content, pos = text[:i], i
    calls: list[RawCall] = []
    while True:
        pos = skip_ws(text, pos + len(HERMES_OPEN))
        obj = scan_call_object(text, pos)
        if obj.call is not None:
            calls.append(obj.call)
        if not obj.complete:
            if not partial:
                raise CutShort
            return content, calls
        pos = skip_ws(text, obj.end)
        after = expect(text, pos, HERMES_CLOSE)
        if after is None:
            if pos >= len(text):  # the model stopped before </tool_call>
                return content, calls
            raise Malformed
        if after < 0:
            return content, calls
        pos = skip_ws(text, after)
        nxt = expect(text, pos, HERMES_OPEN)
        if pos >= len(text) or nxt == -1:
            return content, calls
        if nxt is None:
            return content, calls  # trailing text after the calls is dropped, as llama.cpp
        pos = nxt - len(HERMES_OPEN)


def _llama3(text: str, partial: bool) -> Parsed:
    i = text.find(PYTHON_TAG)
    if i >= 0:  # <|python_tag|>{"name": ..., "parameters": ...} (or code for a built-in tool)
        content, pos = text[:i], skip_ws(text, i + len(PYTHON_TAG))
        if pos < len(text) and text[pos] != "{":
            code = text[pos:]
            return content, [RawCall("python", _json_str({"code": code}) if not partial else "")]
        obj = scan_call_object(text, pos, args_keys=("parameters", "arguments"))
        if not partial and not obj.complete:
            raise CutShort
        return content, [obj.call] if obj.call else []
    start = skip_ws(text, 0)
    if start >= len(text):
        return ("" if partial else text), []
    if text[start] != "{":
        return (cut_partial_marker(text, (PYTHON_TAG,)) if partial else text), []
    try:
        obj = scan_call_object(text, start, args_keys=("parameters", "arguments"))
    except Malformed:
        return text, []
    if not obj.complete:
        if partial:
            return "", [obj.call] if obj.call else []
        if obj.call is not None:
            raise CutShort
        return text, []  # a cut-off object that never became a call: text
    if obj.call is None:
        return text, []
    return "", [obj.call]


def _json_str(x: object) -> str:
    import json

    return json.dumps(x, ensure_ascii=False)


def _mistral(text: str, partial: bool) -> Parsed:
    i = text.find(MISTRAL_TAG)
    if i < 0:
        return (cut_partial_marker(text, (MISTRAL_TAG,)) if partial else text), []
    content, pos = text[:i], skip_ws(text, i + len(MISTRAL_TAG))
    if pos >= len(text):
        return content, []
    return content, _call_array(text, pos, partial)


def _call_array(text: str, pos: int, partial: bool) -> list[RawCall]:
    """The calls of a JSON array of call objects starting at `text[pos]` (`[{...}, {...}]`), as
    far as they go: a partial text may end inside the array, a whole one may not."""
    if text[pos] != "[":
        raise Malformed
    calls: list[RawCall] = []
    pos += 1
    while True:
        pos = skip_ws(text, pos)
        if pos < len(text) and text[pos] == "]" and not calls:
            return calls
        obj = scan_call_object(text, pos)
        if obj.call is not None:
            calls.append(obj.call)
        if not obj.complete:
            if not partial:
                raise CutShort
            return calls
        pos = skip_ws(text, obj.end)
        if pos >= len(text) or text[pos] == "]":
            return calls
        if text[pos] != ",":
            raise Malformed
        pos += 1


def _generic(text: str, partial: bool) -> Parsed:
    start = skip_ws(text, 0)
    if start >= len(text):
        return "", []
    if text[start] != "{":
        raise Malformed
    pos = skip_ws(text, start + 1)
    if pos >= len(text):
        return "", []
    key = partial_string(text, pos)
    if key is None:
        raise Malformed
    if not key[1]:
        return "", []
    pos = skip_ws(text, scan_value(text, pos).end)
    if pos >= len(text):
        return "", []
    if text[pos] != ":":
        raise Malformed
    pos = skip_ws(text, pos + 1)
    if key[0] == "response":
        s = partial_string(text, pos)
        if s is None:
            if pos >= len(text):
                return "", []
            raise Malformed
        if not partial and not s[1]:
            raise CutShort
        return s[0], []
    if key[0] == "tool_call":
        obj = scan_call_object(text, pos)
        if not partial and not obj.complete:
            raise CutShort
        return "", [obj.call] if obj.call else []
    if key[0] == "tool_calls":
        if pos >= len(text):
            return "", []
        return "", _call_array(text, pos, partial)
    raise Malformed


def _deepseek_r1(text: str, partial: bool) -> Parsed:
    i = text.find(F.DS_CALLS_BEGIN)
    j = text.find(F.DS_CALL_BEGIN)  # R1 distills sometimes leave out the outer marker
    if i < 0 or (0 <= j < i):
        i = j
    if i < 0:
        markers = (F.DS_CALLS_BEGIN, F.DS_CALL_BEGIN)
        return (cut_partial_marker(text, markers) if partial else text), []
    content, pos = text[:i], i
    calls: list[RawCall] = []
    if text.startswith(F.DS_CALLS_BEGIN, pos):
        pos += len(F.DS_CALLS_BEGIN)
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text) or text.startswith(F.DS_CALLS_END, pos):
            return content, calls
        after = expect(text, pos, F.DS_CALL_BEGIN)
        if after is None:
            if F.DS_CALLS_END.startswith(text[pos:]):  # the closing marker, cut or whole
                return content, calls
            raise Malformed
        if after < 0:
            return content, calls
        sep = text.find(F.DS_SEP, after)
        if sep < 0:
            if partial:
                return content, calls
            raise CutShort
        nl = text.find("\n", sep)
        if nl < 0:
            if partial:
                return content, calls
            raise CutShort
        name = text[sep + len(F.DS_SEP) : nl].strip()
        pos = nl + 1
        fence = expect(text, pos, "```json")
        if fence is None:
            raise Malformed
        if fence < 0:
            calls.append(RawCall(name, ""))
            return content, calls
        pos = skip_ws(text, fence)
        v = scan_value(text, pos)
        if not v.ok:
            raise Malformed
        if not v.complete:
            if not partial:
                raise CutShort
            calls.append(RawCall(name, text[pos:].rstrip()))
            return content, calls
        calls.append(RawCall(name, text[pos : v.end]))
        pos = skip_ws(text, v.end)
        for word in ("```", F.DS_CALL_END):
            nxt = expect(text, pos, word)
            if nxt is None:
                if pos >= len(text):
                    return content, calls
                raise Malformed
            if nxt < 0:
                return content, calls
            pos = skip_ws(text, nxt)


_PARSERS: dict[ToolFormat, Callable[[str, bool], Parsed]] = {
    ToolFormat.HERMES: _hermes,
    ToolFormat.LLAMA3: _llama3,
    ToolFormat.MISTRAL_NEMO: _mistral,
    ToolFormat.GENERIC: _generic,
    ToolFormat.DEEPSEEK_R1: _deepseek_r1,
    ToolFormat.FUNCTIONARY_V3_2: functionary_v3_2,
}


def parse_chat_output(
    text: str,
    fmt: ToolFormat = ToolFormat.CONTENT_ONLY,
    *,
    partial: bool = False,
    reasoning_format: str = "auto",
    thinking_forced_open: bool = False,
    call_id: Callable[[int], str] | None = None,
    tools: Sequence[Tool] = (),
) -> ChatMessageOut:
    """Parse the generated text. `reasoning_format` "none" leaves thinking in the content;
    `thinking_forced_open`: the prompt ended inside `<think>` (the text starts in thinking).
    `call_id(i)` names the i-th call (default: a fresh `call_...` id) unless the model gave one.
    `tools`: the request's, for formats whose arguments are typed by their schemas (Qwen3-Coder)."""
    if fmt is ToolFormat.GPT_OSS:
        return _harmony(text, partial, reasoning_format == "none", call_id, tools)
    reasoning, rest = "", text
    if reasoning_format != "none":
        reasoning, rest, thinking = split_reasoning(text, thinking_forced_open, partial)
        if thinking:
            return ChatMessageOut("", reasoning)
    parser = _PARSERS.get(fmt)
    if fmt is ToolFormat.QWEN3_CODER:
        parser = partial_fn(qwen3_coder, kinds=param_kinds(tools))
    raw: list[RawCall] = []
    if parser is None:
        content = rest
    else:
        try:
            content, raw = parser(rest, partial)
        except CutShort:  # the end of generation inside a call: kept as the stream showed it
            content, raw = parser(rest, True)
            if not raw and not content:  # nothing was recognised: the text is the answer
                content = rest
        except Malformed:
            content, raw = rest, []
    if raw:
        content = content.rstrip()
    if partial:
        content = content.rstrip()
    name = call_id or (lambda _i: new_call_id())
    calls = [ToolCall(c.name, c.args, c.id or name(i)) for i, c in enumerate(raw)]
    return ChatMessageOut(content, reasoning, calls)


def _harmony(
    text: str, partial: bool, in_content: bool, call_id: Callable[[int], str] | None, tools: Sequence[Tool]
) -> ChatMessageOut:
    """GPT-OSS: the channels say what is reasoning, content and calls (engine/chat/tools/harmony.py);
    only the offered tools' calls are kept."""
    names = {t.name for t in tools}
    try:
        h = parse_harmony(text, partial, reasoning_in_content=in_content, tools=names)
    except CutShort:  # the end of generation inside a call: kept as the stream showed it
        h = parse_harmony(text, True, reasoning_in_content=in_content, tools=names)
    except Malformed:
        h = Harmony(content=text)
    content = h.content.rstrip() if partial or h.calls else h.content
    name = call_id or (lambda _i: new_call_id())
    return ChatMessageOut(
        content, h.reasoning, [ToolCall(c.name, c.args, c.id or name(i)) for i, c in enumerate(h.calls)]
    )
