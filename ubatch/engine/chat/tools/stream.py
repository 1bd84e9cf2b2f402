"""Streaming: the generated text re-parsed as it grows, sent as deltas (llama.cpp's
common_chat_msg_diff). Each new piece re-parses the whole text as partial and sends what the
parse has beyond what was sent, so the deltas always concatenate to the final message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ubatch.engine.chat.tools.formats import ToolFormat
from ubatch.engine.chat.tools.parse import parse_chat_output
from ubatch.engine.chat.tools.types import ChatDelta, ChatMessageOut, Tool, ToolCallDelta, new_call_id


@dataclass(slots=True)
class _Sent:
    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments so far)


class ChatStreamParser:
    """Feed generated text piece by piece; each `feed` returns the delta to send (maybe empty),
    `finish` the last one; `message` is then the whole parsed answer."""

    def __init__(
        self,
        fmt: ToolFormat = ToolFormat.CONTENT_ONLY,
        reasoning_format: str = "auto",
        thinking_forced_open: bool = False,
        tools: Sequence[Tool] = (),
    ) -> None:
        self.fmt, self.reasoning_format, self.thinking_forced_open = fmt, reasoning_format, thinking_forced_open
        self.tools = tuple(tools)
        self.text = ""
        self._sent = _Sent()
        self._ids: list[str] = []
        self.message = ChatMessageOut()

    def _id(self, i: int) -> str:
        while len(self._ids) <= i:  # Mistral's templates want 9 alphanumerics back
            mistral = self.fmt is ToolFormat.MISTRAL_NEMO
            self._ids.append(new_call_id(9, "") if mistral else new_call_id())
        return self._ids[i]

    def _parse(self, partial: bool) -> ChatMessageOut:
        return parse_chat_output(
            self.text,
            self.fmt,
            partial=partial,
            reasoning_format=self.reasoning_format,
            thinking_forced_open=self.thinking_forced_open,
            call_id=self._id,
            tools=self.tools,
        )

    def feed(self, piece: str) -> ChatDelta:
        """More generated text; the delta it makes sendable."""
        if not piece:
            return ChatDelta()
        self.text += piece
        return self._diff(self._parse(partial=True))

    def finish(self) -> ChatDelta:
        """The text is whole: the last delta; `message` holds the answer."""
        msg = self._parse(partial=False)
        for i, c in enumerate(msg.tool_calls):  # the stream's ids, not the model's
            c.id = self._id(i)
        self.message = msg
        return self._diff(msg)

    def _diff(self, msg: ChatMessageOut) -> ChatDelta:
        s = self._sent
        content = _grow(s.content, msg.content)
        reasoning = _grow(s.reasoning, msg.reasoning_content)
        s.content += content
        s.reasoning += reasoning
        deltas = []
        for i, call in enumerate(msg.tool_calls):
            if i < len(s.calls):
                cid, name, args = s.calls[i]
                more = _grow(args, call.arguments)
                if more:
                    deltas.append(ToolCallDelta(i, arguments=more))
                    s.calls[i] = (cid, name, args + more)
            else:
                deltas.append(ToolCallDelta(i, self._id(i), call.name, call.arguments))
                s.calls.append((self._id(i), call.name, call.arguments))
        return ChatDelta(content, reasoning, tuple(deltas))


def _grow(sent: str, now: str) -> str:
    """What `now` adds to `sent` (nothing if it does not extend it: sent text stays sent)."""
    return now[len(sent) :] if now.startswith(sent) else ""
