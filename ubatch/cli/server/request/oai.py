"""OpenAI request bodies (/v1/completions, /v1/chat/completions) translated into llama-server's
native schema (server-common.cpp's oaicompat_*_params_parse).

The OpenAI routes reject what llama-server rejects and rename what it renames, then share the
native path (cli/server/request/params.py) for everything else.
"""

from __future__ import annotations

import json
from typing import Any

from ubatch.cli.server.http import bad_request, type_name
from ubatch.cli.server.request.grammar import response_format_schema
from ubatch.cli.server.request.params import get_int


def oai_completion_body(body: Any) -> dict[str, Any]:
    """/v1/completions: llama-server rejects echo, best_of and suffix; max_tokens is n_predict."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "prompt" not in body:
        raise bad_request('"prompt" is required')
    if body.get("echo"):
        raise bad_request("Only no echo is supported")
    for k in ("best_of", "suffix"):
        if k in body:
            raise bad_request(f"Unsupported param: {k}")
    return dict(body)


def oai_chat_body(body: Any) -> dict[str, Any]:
    """/v1/chat/completions: logprobs -> n_probs = top_logprobs (default 20)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("'messages' is required")
    if not isinstance(msgs, list):
        raise bad_request("Expected 'messages' to be an array")
    if not msgs:  # llama-server renders the bare generation prompt; OpenAI's API and Anthropic's refuse it
        raise bad_request("'messages' must hold at least one message")
    for field, want in (("tools", list), ("response_format", dict)):  # llama-server would ignore these
        v = body.get(field)
        if v is not None and not isinstance(v, want):
            kind = "an array" if want is list else "an object"
            raise bad_request(f"Field '{field}': expected {kind}, got {type_name(v)}")
    out = dict(body)
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad_request(f"Field 'logprobs': expected a boolean, got {type_name(lp)}")
    if lp:
        out["n_probs"] = get_int(body, "top_logprobs", 20, 0, 20)
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs requires logprobs to be set to true")
    if body.get("json_schema") is not None and body.get("grammar"):
        raise bad_request("Cannot use both json_schema and grammar")
    schema = response_format_schema(body)
    if schema is not None:
        if body.get("grammar"):
            raise bad_request("Cannot use both response_format and grammar")
        out["json_schema"] = schema
    out.pop("response_format", None)
    return out


def chat_messages(msgs: list[Any]) -> list[dict[str, Any]]:
    """Validated messages for the template: role and content (text parts joined), and the tool
    fields an assistant or tool message carries (tool_calls, tool_call_id, name,
    reasoning_content), as common_chat_msgs_parse_oaicompat reads them."""
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}]: expected an object with a string 'role'")
        if m["role"] == "assistant" and "content" not in m and "tool_calls" not in m:
            raise bad_request("Assistant message must contain either 'content' or 'tool_calls'!")
        msg: dict[str, Any] = {"role": m["role"], "content": _content(m.get("content"), i)}
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        for k in ("tool_call_id", "name", "reasoning_content"):
            v = m.get(k)
            if v is not None:
                if not isinstance(v, str):
                    raise bad_request(f"messages[{i}].{k}: expected a string, got {type_name(v)}")
                msg[k] = v
        out.append(msg)
    return out


def _content(c: Any, i: int) -> str:
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad_request(f"messages[{i}].content: expected a string or an array of parts")
    parts = []
    for p in c:
        if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type_name(p)
            raise bad_request(
                f"messages[{i}]: content part of type {kind!r} is not supported (text only; this server has no multimodal projector)"
            )
        parts.append(p["text"])
    return "\n".join(parts)


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's calls in OpenAI's shape, arguments as JSON text."""
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls: expected an array")
    out = []
    for j, tc in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(tc, dict) or tc.get("type", "function") != "function":
            raise bad_request(f"{where}: expected an object of type 'function'")
        fn = tc.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}: missing function.name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(tc.get("id"), str):
            call["id"] = tc["id"]
        out.append(call)
    return out
