"""Anthropic Messages bodies (/v1/messages, /v1/messages/count_tokens) translated into the
OpenAI chat shape the rest of the server reads (server-chat.cpp's
server_chat_convert_anthropic_to_oai).

Content blocks become OpenAI messages: `text` blocks the content, `thinking` blocks the
assistant's reasoning_content, `tool_use` blocks its tool_calls, and each `tool_result` a `tool`
message. Tools and tool_choice become OpenAI's. Unlike llama-server, a bad shape is a one-line
400 naming the field rather than a silently dropped block, and a user message's tool results
come before its text, as the templates expect them right after the assistant's calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ubatch.cli.server.http import bad_request, type_name

DEFAULT_MAX_TOKENS = 4096  # llama-server's when a body leaves out max_tokens (Anthropic requires it)
_PASSED = ("temperature", "top_p", "top_k", "stream")  # the same in both APIs
# Claude Code's system prompt starts with a billing line whose 5-character cch stamp changes on
# every request; pinned, as llama-server does, so the prompt cache gets past it.
_BILLING = re.compile(r"^(x-anthropic-billing-header:.*?cch=)[^;]{5};", re.S)


def _system_text(s: str) -> str:
    return _BILLING.sub(r"\1fffff;", s, count=1)


def _texts(v: Any, where: str) -> list[str]:
    """A string, or the texts of text blocks (system, tool_result content)."""
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise bad_request(f"{where}: expected a string or an array of text blocks, got {type_name(v)}")
    for i, b in enumerate(v):
        if not isinstance(b, dict) or b.get("type", "text") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type_name(b)
            raise bad_request(f"{where}[{i}]: block of type {kind!r} is not supported here (text blocks only)")
    return [b["text"] for b in v]


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message -> its OpenAI messages (tool results first, then the rest)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where}: expected an object, got {type_name(m)}")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role: expected 'user' or 'assistant', got {role!r}")
    content = m.get("content", "")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: expected a string or an array of content blocks")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if not isinstance(b, dict) or not isinstance(kind, str):
            raise bad_request(f"{at}: expected a content block with a string 'type'")
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise bad_request(f"{at}.text: expected a string")
            texts.append(b["text"])
        elif kind == "thinking":
            thought = b.get("thinking")
            reasoning.append(thought if isinstance(thought, str) else "")
        elif kind == "redacted_thinking":
            continue  # opaque to a local model
        elif kind == "tool_use":
            if role != "assistant":
                raise bad_request(f"{at}: tool_use blocks belong to assistant messages")
            name, inp = b.get("name"), b.get("input", {})
            if not isinstance(name, str) or not name:
                raise bad_request(f"{at}.name: expected a non-empty string")
            if not isinstance(inp, dict):
                raise bad_request(f"{at}.input: expected an object, got {type_name(inp)}")
            call_id = b.get("id") if isinstance(b.get("id"), str) else ""
            args = json.dumps(inp, ensure_ascii=False)
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "tool_result":
            if role != "user":
                raise bad_request(f"{at}: tool_result blocks belong to user messages")
            tid = b.get("tool_use_id")
            if not isinstance(tid, str):
                raise bad_request(f"{at}.tool_use_id: expected a string")
            text = "".join(_texts(b["content"], f"{at}.content")) if b.get("content") is not None else ""
            results.append({"role": "tool", "tool_call_id": tid, "content": text})
        else:
            raise bad_request(
                f"{at}: content block of type {kind!r} is not supported (text, thinking, tool_use and tool_result only; this server has no multimodal projector)"
            )
    out = list(results)
    if texts or calls or reasoning or not results:
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        out.append(msg)
    return out


def _tools(v: Any) -> list[dict[str, Any]]:
    """Anthropic's {name, description, input_schema} tools -> OpenAI's function tools."""
    if not isinstance(v, list):
        raise bad_request(f"tools: expected an array, got {type_name(v)}")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{i}]: expected an object with a non-empty string 'name'")
        fn: dict[str, Any] = {"name": t["name"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if t.get("input_schema") is not None:  # absent (a server tool's shape): any arguments
            if not isinstance(t["input_schema"], dict):
                raise bad_request(f"tools[{i}].input_schema: expected an object, got {type_name(t['input_schema'])}")
            fn["parameters"] = t["input_schema"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any, out: dict[str, Any]) -> None:
    """Anthropic's tool_choice -> OpenAI's tool_choice and parallel_tool_calls in `out`."""
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad_request("tool_choice: expected an object with a string 'type'")
    kind = v["type"]
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool":
        if not isinstance(v.get("name"), str):
            raise bad_request("tool_choice.name: expected a string for type 'tool'")
        out["tool_choice"] = {"type": "function", "function": {"name": v["name"]}}
    else:
        raise bad_request(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none', got {kind!r}")
    if v.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False


def _thinking(v: Any, out: dict[str, Any]) -> None:
    """thinking {"type": "enabled" | "disabled", "budget_tokens"?}: "disabled" turns the
    template's thinking off (chat_template_kwargs.enable_thinking); "enabled" passes its budget
    on as llama-server's thinking_budget_tokens (10000 when it gives none, as llama-server),
    which the reasoning budget then enforces."""
    if not isinstance(v, dict) or v.get("type") not in ("enabled", "disabled", "adaptive"):
        raise bad_request("thinking: expected an object with 'type' 'enabled' or 'disabled'")
    budget = v.get("budget_tokens")
    if v["type"] == "enabled":
        out["thinking_budget_tokens"] = budget if isinstance(budget, int) and not isinstance(budget, bool) else 10000
    if v["type"] == "disabled":
        kwargs = out.get("chat_template_kwargs")
        out["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": False}


def anthropic_chat(body: Any, count_only: bool = False) -> dict[str, Any]:
    """A /v1/messages body as an OpenAI chat body (for count_tokens: no max_tokens needed, and
    the sampling fields are left out)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("'messages' is required")
    if not isinstance(msgs, list):
        raise bad_request(f"'messages' must be an array, got {type_name(msgs)}")
    if not msgs and not count_only:  # Anthropic's API: at least one message
        raise bad_request("'messages' must hold at least one message")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = "".join(_system_text(t) for t in _texts(body["system"], "system"))
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(msgs):
        messages += _message(m, i)
    out: dict[str, Any] = {"messages": messages}
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], out)
    if body.get("chat_template_kwargs") is not None:  # llama-server passes it through
        out["chat_template_kwargs"] = body["chat_template_kwargs"]
    if body.get("thinking") is not None:
        _thinking(body["thinking"], out)
    if count_only:
        return out
    out["max_tokens"] = DEFAULT_MAX_TOKENS if body.get("max_tokens") is None else body["max_tokens"]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request("stop_sequences: expected an array of strings")
        out["stop"] = stops
    for k in _PASSED:
        if body.get(k) is not None:
            out[k] = body[k]
    return out
