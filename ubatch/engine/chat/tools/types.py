"""The plain data of tool calling: tools offered, the choice asked for, calls made, and the
parsed assistant message with its OpenAI JSON form."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Literal

ChoiceMode = Literal["auto", "none", "required"]
_ID_CHARS = string.ascii_letters + string.digits


def new_call_id(length: int = 24, prefix: str = "call_") -> str:
    """A fresh tool call id (Mistral's templates insist on 9 alphanumerics: prefix "", length 9)."""
    return prefix + "".join(secrets.choice(_ID_CHARS) for _ in range(length))


@dataclass(frozen=True, slots=True)
class Tool:
    """One function a request offers: its name, description and JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, object] = field(default_factory=dict)

    def to_openai(self) -> dict[str, object]:
        """The `tools` entry as OpenAI sends it and as llama.cpp hands it to the templates."""
        fn: dict[str, object] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`tool_choice`: auto (the model decides), none, required (some call), or one named function."""

    mode: ChoiceMode = "auto"
    name: str | None = None  # a named function: mode is "required" and only this one may be called


@dataclass(slots=True)
class ToolCall:
    """One call the model made; `arguments` is JSON text, as the OpenAI API carries it."""

    name: str
    arguments: str
    id: str = ""

    def to_openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ChatMessageOut:
    """The assistant's answer parsed: visible text, thinking text, and calls."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        """ "tool_calls" when the model called something; the caller keeps its own otherwise."""
        return "tool_calls" if self.tool_calls else "stop"

    def to_openai(self) -> dict[str, object]:
        """The `message` of a chat completion choice, as llama-server's common_chat_msg JSON:
        content is "" (never null) when there is no text, calls or not; reasoning_content only
        when there is some."""
        out: dict[str, object] = {"role": "assistant", "content": self.content}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of one call in a stream: the id and name come once, with the call's first piece;
    the arguments' JSON text comes in pieces that concatenate to the whole."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, object]:
        fn: dict[str, object] = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        out: dict[str, object] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        out["function"] = fn
        return out


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """What a stream sends for some new text: more content, more reasoning, pieces of calls."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)

    def to_openai(self) -> dict[str, object]:
        """The `delta` of a streamed chunk."""
        out: dict[str, object] = {}
        if self.content:
            out["content"] = self.content
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [d.to_openai() for d in self.tool_calls]
        return out
