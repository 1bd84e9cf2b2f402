"""Tool calls and reasoning for chat completions: the tools a request offers, rendered through
the chat template; the grammar that makes a model's call well-formed; and the model's text parsed
back into content, reasoning and calls (whole, or as streaming deltas), in the format its
template was trained on (llama.cpp's common/chat.cpp formats)."""

from __future__ import annotations

from ubatch.engine.chat.tools.formats import ToolFormat, detect_tool_format
from ubatch.engine.chat.tools.grammar import ToolGrammar, build_tool_grammar
from ubatch.engine.chat.tools.parse import parse_chat_output
from ubatch.engine.chat.tools.prepare import PreparedChat, prepare_chat
from ubatch.engine.chat.tools.request import (
    REASONING_FORMATS,
    ToolRequestError,
    parse_reasoning_format,
    parse_tool_choice,
    parse_tools,
)
from ubatch.engine.chat.tools.stream import ChatStreamParser
from ubatch.engine.chat.tools.types import ChatDelta, ChatMessageOut, Tool, ToolCall, ToolCallDelta, ToolChoice

__all__ = [
    "REASONING_FORMATS",
    "ChatDelta",
    "ChatMessageOut",
    "ChatStreamParser",
    "PreparedChat",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolFormat",
    "ToolGrammar",
    "ToolRequestError",
    "build_tool_grammar",
    "detect_tool_format",
    "parse_chat_output",
    "parse_reasoning_format",
    "parse_tool_choice",
    "parse_tools",
    "prepare_chat",
]
