"""The chat formats written out by hand, as llama.cpp's llm_chat_apply_template writes them:
what a model gets when its GGUF has no Jinja template, or when Jinja is off."""

from __future__ import annotations

from typing import Any

_WS = " \t\n\r\v\f"  # llama-chat.cpp's trim(): std::isspace


def trim(s: str) -> str:
    """llama-chat.cpp's trim(): strip C isspace characters (not Unicode spaces) at both ends."""
    return s.strip(_WS)


def _gemma(msgs: list[dict[str, Any]], add_ass: bool) -> str:
    out, system = [], ""
    for m in msgs:
        role = m["role"]
        if role == "system":  # no system turn in gemma: merged into the next user turn
            system += trim(m["content"])
            continue
        role = "model" if role == "assistant" else role
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(trim(m["content"]) + "<end_of_turn>\n")
    if add_ass:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _chatml(msgs: list[dict[str, Any]], add_ass: bool) -> str:
    out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs]
    if add_ass:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _llama3(msgs: list[dict[str, Any]], add_ass: bool) -> str:
    out = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{trim(m['content'])}<|eot_id|>" for m in msgs]
    if add_ass:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


BUILTIN = {"gemma": _gemma, "chatml": _chatml, "llama3": _llama3}
