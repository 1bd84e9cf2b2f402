"""GPT-OSS's harmony format: the reply is a run of messages, each a header and a body,
`<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>text`.
The analysis channel is the reasoning, the final channel (and a commentary without a recipient,
a preamble) the content, and a message addressed `to=functions.NAME` (in the channel's header or
before it, in the role's) a call whose body is its JSON arguments. The first `<|start|>assistant`
is the prompt's; `<|call|>` and `<|return|>`, which end a reply, are end-of-generation tokens and
never in the text.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field

from ubatch.engine.chat.tools.calls import CutShort, Malformed, RawCall, cut_partial_marker
from ubatch.engine.chat.tools.jsonscan import scan_value, skip_ws

START = "<|start|>assistant"
CHANNEL, MESSAGE, END, CONSTRAIN = "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
ANALYSIS = CHANNEL + "analysis" + MESSAGE  # the thinking block's start, as a reasoning budget sees it
MARKERS = (START, CHANNEL, MESSAGE, END)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


@dataclass(slots=True)
class Harmony:
    """A reply read: the reasoning, the content and the calls (in the order written)."""

    reasoning: str = ""
    content: str = ""
    calls: list[RawCall] = field(default_factory=list)


def _header_ok(header: str) -> bool:
    """A message header starts with its channel or, in the role's header, its recipient."""
    return header.startswith(CHANNEL) or header.lstrip().startswith("to=")


def parse_harmony(
    text: str, partial: bool, *, reasoning_in_content: bool = False, tools: Collection[str] | None = None
) -> Harmony:
    """Read the messages. `reasoning_in_content` (reasoning_format none): an analysis message
    is content, markers and all. `tools`: the functions offered; a call to anything else (a
    built-in tool, or tools not offered) is dropped, as llama.cpp consumes it. Raises Malformed
    for text that is not harmony, CutShort for a whole text that ends inside a call."""
    out = Harmony()
    pos = 0
    while pos < len(text):
        if text.startswith(START, pos):
            pos += len(START)
        elif START.startswith(text[pos:]):  # `<|start|>assistant` cut short
            break
        at = text.find(MESSAGE, pos)
        header = text[pos:] if at < 0 else text[pos:at]
        if not _header_ok(header) and not (CHANNEL.startswith(header) or "to=".startswith(header.lstrip())):
            raise Malformed
        if at < 0:  # the header is still being written
            break
        body_at = at + len(MESSAGE)
        end = text.find(END, body_at)
        body = text[body_at:] if end < 0 else text[body_at:end]
        if end < 0 and partial:
            body = cut_partial_marker(body, (END,))
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None:
            name = recipient.group(1)
            if name.startswith("functions.") and (tools is None or name[len("functions.") :] in tools):
                _call(out, name[len("functions.") :], body, partial, end < 0)
        elif channel is not None and channel.group(1) == "analysis":
            if reasoning_in_content:
                out.content += text[pos:body_at] + body + (END if end >= 0 else "")
            else:
                out.reasoning += body
        else:  # final, or a commentary without a recipient (a preamble)
            out.content += body
        if end < 0:
            break
        pos = end + len(END)
    return out


def _call(out: Harmony, name: str, body: str, partial: bool, open_: bool) -> None:
    """A call's body: its JSON arguments (as far as they go while the text is open)."""
    start = skip_ws(body, 0)
    v = scan_value(body, start)
    if not v.ok or (start < len(body) and body[start] != "{"):
        raise Malformed
    if v.complete:
        out.calls.append(RawCall(name, body[start : v.end]))
    elif not open_:  # `<|end|>` inside the arguments
        raise Malformed
    elif not partial:
        raise CutShort
    else:
        out.calls.append(RawCall(name, body[start:].rstrip()))
