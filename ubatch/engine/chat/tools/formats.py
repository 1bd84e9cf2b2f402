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
    FUNCTIONARY_V3_2 = "functionary-v3.2"  # (the prompt ends in >>>) all\ntext>>>name\n{...}>>>name\n{...}
    GPT_OSS = "gpt-oss"  # harmony: <|channel|>analysis<|message|>...<|end|><|start|>assistant to=functions.name...
    QWEN3_CODER = "qwen3-coder"  # <tool_call>\n<function=name>\n<parameter=x>\nvalue\n</parameter>\n</function>


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
    if "<|channel|>" in source:
        return ToolFormat.GPT_OSS
    if ">>>all" in source and ">>>${recipient}" in source:  # before Llama 3: it uses Llama 3's headers
        return ToolFormat.FUNCTIONARY_V3_2
    if DS_CALLS_BEGIN in source:
        return ToolFormat.DEEPSEEK_R1
    if "[TOOL_CALLS]" in source:
        return ToolFormat.MISTRAL_NEMO
    if is_qwen3_coder(source):  # before Hermes: both open calls with <tool_call>
        return ToolFormat.QWEN3_CODER
    if "<tool_call>" in source:
        return ToolFormat.HERMES
    if "<|start_header_id|>" in source and ("ipython<|end_header_id|>" in source or "<|python_tag|>" in source):
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC


def supports_thinking(source: str | None) -> bool:
    """Does the template know `<think>` blocks (Qwen 3, DeepSeek R1, QwQ)?"""
    return bool(source) and ("<think>" in (source or "") or "</think>" in (source or ""))


def is_qwen3_coder(source: str) -> bool:
    """Qwen3-Coder's XML calls (also Qwen 3.5's, Nemotron Nano 3's): `<function=` and `<parameter=`
    inside `<tool_call>`, with the newlines between tags llama.cpp's parser expects."""
    tags = all(t in source for t in ("<tool_call>", "<function=", "<parameter="))
    return tags and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in source
