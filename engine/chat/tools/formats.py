"""Which tool-call format a model speaks, read from its chat template the way llama.cpp's
common/chat.cpp tells them apart (by text only the family's template contains)."""

from __future__ import annotations

from enum import StrEnum


class ToolFormat(StrEnum):
    """The formats the parser and grammar know; GENERIC is the one any model can be taught."""

    CONTENT_ONLY = "content-only"  # no tools offered: text (and thinking) only
    GENERIC = "generic"  # {"tool_call": {...}} / {"tool_calls": [...]} / {"response": "..."}
    HERMES = "hermes"  # <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> (Qwen 2.5/3, Hermes)
    LLAMA3 = "llama3"  # {"name": ..., "parameters": ...}, or after <|python_tag|> (Llama 3.1-3.3)
    MISTRAL_NEMO = "mistral-nemo"  # [TOOL_CALLS][{"name": ..., "arguments": ..., "id": ...}]
    DEEPSEEK_R1 = "deepseek-r1"  # <｜tool▁calls▁begin｜>...function<｜tool▁sep｜>name\n```json ...


# DeepSeek R1's tool-call markers (full-width bars and the "▁" of its vocabulary)
DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"


def detect_tool_format(source: str | None) -> ToolFormat:
    """The format for a Jinja template source (None: a built-in format, which knows no tools)."""
    if not source:
        return ToolFormat.GENERIC
    if DS_CALLS_BEGIN in source:
        return ToolFormat.DEEPSEEK_R1
    if "[TOOL_CALLS]" in source:
        return ToolFormat.MISTRAL_NEMO
    if "<tool_call>" in source:
        return ToolFormat.HERMES
    if "<|start_header_id|>" in source and ("ipython<|end_header_id|>" in source or "<|python_tag|>" in source):
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC


def supports_thinking(source: str | None) -> bool:
    """Does the template know `<think>` blocks (Qwen 3, DeepSeek R1, QwQ)?"""
    return bool(source) and ("<think>" in (source or "") or "</think>" in (source or ""))
