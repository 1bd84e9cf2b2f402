"""The chat formats written out by hand, as llama.cpp's llm_chat_apply_template writes them:
what a model gets when its GGUF has no Jinja template, or when Jinja is off."""

from __future__ import annotations

from collections.abc import Callable

Turn = tuple[str, str]  # (role, content text) of a checked message
_WS = " \t\n\r\v\f"  # llama-chat.cpp's trim(): std::isspace


def trim(s: str) -> str:
    """llama-chat.cpp's trim(): strip C isspace characters (not Unicode spaces) at both ends."""
    return s.strip(_WS)


def _gemma(turns: list[Turn], add_ass: bool) -> str:
    out, system = [], ""
    for role, content in turns:
        if role == "system":  # no system turn in gemma: merged into the next user turn
            system += trim(content)
            continue
        role = "model" if role == "assistant" else role
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(trim(content) + "<end_of_turn>\n")
    if add_ass:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _chatml(turns: list[Turn], add_ass: bool) -> str:
    out = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns]
    if add_ass:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _llama3(turns: list[Turn], add_ass: bool) -> str:
    out = [f"<|start_header_id|>{role}<|end_header_id|>\n\n{trim(content)}<|eot_id|>" for role, content in turns]
    if add_ass:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


BUILTIN: dict[str, Callable[[list[Turn], bool], str]] = {"gemma": _gemma, "chatml": _chatml, "llama3": _llama3}
