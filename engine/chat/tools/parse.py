"""The model's text -> content, reasoning and tool calls, per format (llama.cpp's chat parser).

Every parser also reads text cut short (`partial=True`, a stream mid-way): markers that may be
the start of a tag are held back, a call appears once its name is whole, and its arguments are
the JSON text written so far. Whatever a partial parse returns is a prefix of what the whole
text parses to (the stream's deltas rely on it). A call that is not well-formed makes the whole
answer content, as llama.cpp falls back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ubatch.engine.chat.tools import formats as F
from ubatch.engine.chat.tools.formats import ToolFormat
from ubatch.engine.chat.tools.jsonscan import partial_string, scan_value, skip_ws
from ubatch.engine.chat.tools.types import ChatMessageOut, ToolCall, new_call_id

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


class _Malformed(Exception):
    """The calls are not in the format: the text is content."""


@dataclass(slots=True)
class RawCall:
    name: str
    args: str  # JSON text as written (so far, when partial)
    id: str | None = None


def cut_partial_marker(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a tail that may still grow into one of `markers` (held back)."""
    cut = len(text)
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                cut = min(cut, len(text) - n)
                break
    return text[:cut]


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
    """Read a call object at `pos` (raises _Malformed); partial objects give what is whole."""
    n = len(text)
    if pos >= n:
        return _Obj(None, n, False)
    if text[pos] != "{":
        raise _Malformed
    pos += 1
    name: str | None = None
    args: str | None = None
    call_id: str | None = None
    first = True

    def result(complete: bool, end: int) -> _Obj:
        if name is None:
            if complete:
                raise _Malformed
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
            raise _Malformed
        k, closed = key
        if not closed:
            return result(False, n)
        pos = skip_ws(text, scan_value(text, pos).end)
        if pos >= n:
            return result(False, n)
        if text[pos] != ":":
            raise _Malformed
        pos = skip_ws(text, pos + 1)
        if pos >= n:
            return result(False, n)
        if k in name_keys or k == "id":
            s = partial_string(text, pos)
            if s is None:
                raise _Malformed
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
                raise _Malformed
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
            raise _Malformed
        pos += 1


def _expect(text: str, pos: int, word: str) -> int | None:
    """Position after `word` at `pos`; -1 when the text ends inside it; None if something else."""
    tail = text[pos : pos + len(word)]
    if tail == word:
        return pos + len(word)
    if len(tail) < len(word) and word.startswith(tail):
        return -1
    return None


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
            if not partial and obj.call is not None and _whole_args(obj.call):
                return content, calls  # no closing brace: keep what parses
            if not partial:
                raise _Malformed
            return content, calls
        pos = skip_ws(text, obj.end)
        after = _expect(text, pos, HERMES_CLOSE)
        if after is None:
            if pos >= len(text):  # the model stopped before </tool_call>
                return content, calls
            raise _Malformed
        if after < 0:
            return content, calls
        pos = skip_ws(text, after)
        nxt = _expect(text, pos, HERMES_OPEN)
        if pos >= len(text) or nxt == -1:
            return content, calls
        if nxt is None:
            return content, calls  # trailing text after the calls is dropped, as llama.cpp
        pos = nxt - len(HERMES_OPEN)


def _whole_args(call: RawCall) -> bool:
    return bool(call.args) and scan_value(call.args, 0).complete


def _llama3(text: str, partial: bool) -> Parsed:
    i = text.find(PYTHON_TAG)
    if i >= 0:  # <|python_tag|>{"name": ..., "parameters": ...} (or code for a built-in tool)
        content, pos = text[:i], skip_ws(text, i + len(PYTHON_TAG))
        if pos < len(text) and text[pos] != "{":
            code = text[pos:]
            return content, [RawCall("python", _json_str({"code": code}) if not partial else "")]
        obj = scan_call_object(text, pos, args_keys=("parameters", "arguments"))
        if not partial and not obj.complete:
            raise _Malformed
        return content, [obj.call] if obj.call else []
    start = skip_ws(text, 0)
    if start >= len(text):
        return ("" if partial else text), []
    if text[start] != "{":
        return (cut_partial_marker(text, (PYTHON_TAG,)) if partial else text), []
    try:
        obj = scan_call_object(text, start, args_keys=("parameters", "arguments"))
    except _Malformed:
        return text, []
    if not obj.complete:
        if partial:
            return "", [obj.call] if obj.call else []
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
        raise _Malformed
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
                raise _Malformed
            return calls
        pos = skip_ws(text, obj.end)
        if pos >= len(text) or text[pos] == "]":
            return calls
        if text[pos] != ",":
            raise _Malformed
        pos += 1


def _generic(text: str, partial: bool) -> Parsed:
    start = skip_ws(text, 0)
    if start >= len(text):
        return "", []
    if text[start] != "{":
        raise _Malformed
    pos = skip_ws(text, start + 1)
    key = partial_string(text, pos)
    if key is None:
        raise _Malformed
    if not key[1]:
        return "", []
    pos = skip_ws(text, scan_value(text, pos).end)
    if pos >= len(text):
        return "", []
    if text[pos] != ":":
        raise _Malformed
    pos = skip_ws(text, pos + 1)
    if key[0] == "response":
        s = partial_string(text, pos)
        if s is None:
            if pos >= len(text):
                return "", []
            raise _Malformed
        if not partial and not s[1]:
            raise _Malformed
        return s[0], []
    if key[0] == "tool_call":
        obj = scan_call_object(text, pos)
        if not partial and not obj.complete:
            raise _Malformed
        return "", [obj.call] if obj.call else []
    if key[0] == "tool_calls":
        if pos >= len(text):
            return "", []
        return "", _call_array(text, pos, partial)
    raise _Malformed


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
        after = _expect(text, pos, F.DS_CALL_BEGIN)
        if after is None:
            if partial and F.DS_CALLS_END.startswith(text[pos:]):
                return content, calls
            raise _Malformed
        if after < 0:
            return content, calls
        sep = text.find(F.DS_SEP, after)
        if sep < 0:
            if partial:
                return content, calls
            raise _Malformed
        nl = text.find("\n", sep)
        if nl < 0:
            if partial:
                return content, calls
            raise _Malformed
        name = text[sep + len(F.DS_SEP) : nl].strip()
        pos = nl + 1
        fence = _expect(text, pos, "```json")
        if fence is None:
            raise _Malformed
        if fence < 0:
            calls.append(RawCall(name, ""))
            return content, calls
        pos = skip_ws(text, fence)
        v = scan_value(text, pos)
        if not v.ok:
            raise _Malformed
        if not v.complete:
            if not partial:
                raise _Malformed
            calls.append(RawCall(name, text[pos:].rstrip()))
            return content, calls
        calls.append(RawCall(name, text[pos : v.end]))
        pos = skip_ws(text, v.end)
        for word in ("```", F.DS_CALL_END):
            nxt = _expect(text, pos, word)
            if nxt is None:
                if pos >= len(text):
                    return content, calls
                raise _Malformed
            if nxt < 0:
                return content, calls
            pos = skip_ws(text, nxt)


_PARSERS: dict[ToolFormat, Callable[[str, bool], Parsed]] = {
    ToolFormat.HERMES: _hermes,
    ToolFormat.LLAMA3: _llama3,
    ToolFormat.MISTRAL_NEMO: _mistral,
    ToolFormat.GENERIC: _generic,
    ToolFormat.DEEPSEEK_R1: _deepseek_r1,
}


def parse_chat_output(
    text: str,
    fmt: ToolFormat = ToolFormat.CONTENT_ONLY,
    *,
    partial: bool = False,
    reasoning_format: str = "auto",
    thinking_forced_open: bool = False,
    call_id: Callable[[int], str] | None = None,
) -> ChatMessageOut:
    """Parse the generated text. `reasoning_format` "none" leaves thinking in the content;
    `thinking_forced_open`: the prompt ended inside `<think>` (the text starts in thinking).
    `call_id(i)` names the i-th call (default: a fresh `call_...` id) unless the model gave one."""
    reasoning, rest = "", text
    if reasoning_format != "none":
        reasoning, rest, thinking = split_reasoning(text, thinking_forced_open, partial)
        if thinking:
            return ChatMessageOut("", reasoning)
    parser = _PARSERS.get(fmt)
    raw: list[RawCall] = []
    if parser is None:
        content = rest
    else:
        try:
            content, raw = parser(rest, partial)
        except _Malformed:
            content, raw = rest, []
        if fmt is ToolFormat.GENERIC and not raw and content == rest and not partial:
            pass  # a model that answered without the JSON wrapper: its text is the answer
    if raw:
        content = content.rstrip()
    if partial:
        content = content.rstrip()
    name = call_id or (lambda _i: new_call_id())
    calls = [ToolCall(c.name, c.args, c.id or name(i)) for i, c in enumerate(raw)]
    return ChatMessageOut(content, reasoning, calls)
