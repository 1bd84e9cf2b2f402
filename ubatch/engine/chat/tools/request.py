"""The request's `tools`, `tool_choice` and `reasoning_format` checked, with one-line errors a
server answers with 400 (llama-server's wording where it has one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ubatch.engine.chat.tools.types import Tool, ToolChoice

REASONING_FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")


class ToolRequestError(ValueError):
    """A request's tools, tool choice or reasoning format that cannot be used (HTTP 400)."""


def parse_tools(tools: object) -> list[Tool]:
    """OpenAI `tools` ([{type: function, function: {name, description, parameters}}]) -> Tools.
    None or [] is no tools."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ToolRequestError("'tools' must be an array of {type: function, function: {...}} objects")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise ToolRequestError(f"tools[{i}] must be an object")
        if t.get("type", "function") != "function":
            raise ToolRequestError(f"tools[{i}]: unsupported tool type {t.get('type')!r} (only 'function')")
        fn = t.get("function")
        if not isinstance(fn, Mapping):
            raise ToolRequestError(f"tools[{i}]: missing 'function' object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolRequestError(f"tools[{i}].function: missing 'name'")
        desc = fn.get("description", "")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise ToolRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append(Tool(name, desc if isinstance(desc, str) else "", dict(params)))
    return out


def parse_tool_choice(choice: object, tools: Sequence[Tool] = ()) -> ToolChoice:
    """`tool_choice`: "auto" | "none" | "required" | {type: function, function: {name}}
    (missing: auto)."""
    if choice is None:
        return ToolChoice("auto")
    if isinstance(choice, str):
        if choice == "auto":
            return ToolChoice("auto")
        if choice == "none":
            return ToolChoice("none")
        if choice == "required":
            return ToolChoice("required")
        raise ToolRequestError(f"Invalid tool_choice: {choice}")
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ToolRequestError("tool_choice: a named choice needs {type: function, function: {name}}")
        if tools and name not in {t.name for t in tools}:
            raise ToolRequestError(f"tool_choice names {name!r}, which is not among the tools")
        return ToolChoice("required", name)
    raise ToolRequestError("tool_choice must be a string or an object")


def parse_reasoning_format(value: object, default: str = "auto") -> str:
    """llama.cpp's reasoning formats; None keeps the server's (--reasoning-format)."""
    if value is None:
        return default
    if isinstance(value, str) and value in REASONING_FORMATS:
        return value
    raise ToolRequestError(f"Unknown reasoning format: {value} (use one of {', '.join(REASONING_FORMATS)})")
