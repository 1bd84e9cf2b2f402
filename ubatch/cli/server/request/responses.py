"""OpenAI Responses request bodies (/v1/responses, /v1/responses/input_tokens) turned into chat
completion bodies, as llama-server's server_chat_convert_responses_to_chatcmpl does: the
Responses API is a chat completion with another shape on both sides.

`input` (a string, or items: messages with input_text/output_text parts, function_call,
function_call_output and reasoning items) becomes `messages` (assistant items in a row merge into
one message), `instructions` a system message, Responses' flat function tools OpenAI chat's
`tools`, `max_output_tokens` `max_tokens`; every other field passes through (so llama.cpp's own
sampling fields work here too). Responses are not stored: `previous_response_id` is refused.
"""

from __future__ import annotations

from typing import Any

from ubatch.cli.server.http import bad_request


def _is_str(d: Any, key: str) -> bool:
    return isinstance(d, dict) and isinstance(d.get(key), str)


def _input_parts(content: list[Any]) -> list[dict[str, Any]]:
    """A user/system/developer message's parts: input_text only (this server is text-only)."""
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_text":
            if not _is_str(part, "text"):
                raise bad_request("'Input text' requires 'text'")
            out.append({"type": "text", "text": part["text"]})
        elif kind in ("input_image", "input_file"):
            raise bad_request(f"'{kind}' is not supported: this server has no multimodal projector")
        else:
            raise bad_request("'type' must be one of 'input_text', 'input_image', or 'input_file'")
    return out


def _output_parts(item: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message item's parts: output_text (or input_text) and refusal, as text."""
    c = item.get("content")
    if isinstance(c, str):
        return [{"type": "text", "text": c}]
    out = []
    for part in c if isinstance(c, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("output_text", "input_text"):
            if not _is_str(part, "text"):
                raise bad_request("'Output text' requires 'text'")
            out.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            if not _is_str(part, "refusal"):
                raise bad_request("'Refusal' requires 'refusal'")
            out.append({"type": "text", "text": part["refusal"]})
        else:
            raise bad_request("'type' must be one of 'output_text' or 'refusal'")
    return out


def _assistant(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the next output item joins: the last one, or a new one."""
    if not msgs or msgs[-1]["role"] != "assistant":
        msgs.append({"role": "assistant", "content": []})
    return msgs[-1]


def _output_text(msg: dict[str, Any]) -> list[Any]:
    if not isinstance(msg.get("content"), list):
        msg["content"] = [] if not msg.get("content") else [{"type": "text", "text": msg["content"]}]
    parts: list[Any] = msg["content"]
    return parts


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise bad_request("'input' must be a string or array of objects")
        kind, role = item.get("type"), item.get("role")
        if isinstance(role, str) and role in ("user", "system", "developer") and kind in (None, "message"):
            c = item.get("content")
            parts = [{"type": "input_text", "text": c}] if isinstance(c, str) else c
            if not isinstance(parts, list):
                raise bad_request("Cannot determine type of 'item'")
            msgs.append({"role": role, "content": _input_parts(parts)})
        elif role == "assistant" and kind in (None, "message"):
            _output_text(_assistant(msgs)).extend(_output_parts(item))
        elif kind == "function_call":
            if not (_is_str(item, "arguments") and _is_str(item, "call_id") and _is_str(item, "name")):
                raise bad_request("a 'function_call' item requires 'call_id', 'name' and 'arguments' strings")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            _assistant(msgs).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out = item.get("output")
            if not _is_str(item, "call_id") or not isinstance(out, str | list):
                raise bad_request("a 'function_call_output' item requires 'call_id' and 'output'")
            if isinstance(out, list):
                if any(not isinstance(p, dict) or p.get("type") != "input_text" for p in out):
                    raise bad_request("Output of tool call should be 'Input text' (this server is text-only)")
                out = _input_parts(out)
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": out})
        elif kind == "reasoning":
            c = item.get("content")
            if not isinstance(c, list) or not c or not _is_str(c[0], "text"):
                summary = item.get("summary")
                c = summary if isinstance(summary, list) and summary and _is_str(summary[0], "text") else None
            if c is not None:
                _assistant(msgs)["reasoning_content"] = c[0]["text"]
        else:
            raise bad_request("Cannot determine type of 'item'")
    return msgs


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools -> chat tools; other tool types (web search, ...) have no
    chat counterpart and are skipped, as llama-server skips them."""
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array of objects")
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function":
            continue
        fn = {k: v for k, v in t.items() if k != "type"}
        fn.setdefault("strict", True)
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    """{"type": "function", "name": ...} (Responses) -> chat's {"type": "function", "function": {...}}."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def responses_to_chat(body: Any) -> dict[str, Any]:
    """A Responses body -> the chat completion body it stands for (a 400 for a bad one)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "input" not in body:
        raise bad_request("'input' is required")
    if body.get("previous_response_id"):
        raise bad_request("llama.cpp does not support 'previous_response_id'.")
    out = {k: v for k, v in body.items() if k not in ("input", "instructions", "tools", "max_output_tokens", "text")}
    msgs: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad_request("'instructions' must be a string")
        msgs.append({"role": "system", "content": body["instructions"]})
    inp = body["input"]
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        msgs += _messages(inp)
    else:
        raise bad_request("'input' must be a string or array of objects")
    out["messages"] = msgs
    if body.get("tools") is not None:
        tools = _tools(body["tools"])
        if tools:
            out["tools"] = tools
    if "tool_choice" in body:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema") or {}}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    out.pop("reasoning", None)
    return out
