"""A chat request's tools and reasoning: what llama-server's oaicompat_chat_params_parse reads
besides the messages (`tools`, `tool_choice`, `parallel_tool_calls`, `reasoning_format`, the
thinking switches), checked, then the prompt rendered and planned by the engine's
`prepare_chat` into a `ChatPlan`.

The plan decides what the template is given (the tools, whether thinking is enabled), the
grammar that makes a call well-formed (forced for a required or named choice, lazy for "auto"),
and how the reply is read back (content, reasoning_content, tool_calls) in the format the
template was trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ubatch.cli.server.http import bad_request, type_name
from ubatch.cli.server.request.grammar import compile_request_grammar, sampler_error
from ubatch.engine.chat.template import ChatTemplate
from ubatch.engine.chat.tools import (
    ChatMessageOut,
    ChatStreamParser,
    PreparedChat,
    ToolFormat,
    ToolRequestError,
    parse_chat_output,
    prepare_chat,
)
from ubatch.engine.grammar import Grammar, GrammarError
from ubatch.engine.grammar.budget import WorkCancelled


@dataclass(slots=True)
class ChatRequest:
    """The request's tool and reasoning fields, checked (before rendering)."""

    tools: Any = None  # the JSON `tools` (checked by prepare_chat)
    tool_choice: Any = None
    parallel: bool = True
    reasoning_format: Any = None  # the request's (None: the server's)
    enable_thinking: bool = True
    template_kwargs: dict[str, object] = field(default_factory=dict)

    @property
    def calls_tools(self) -> bool:
        """Tools are offered and may be called (llama-server's parse_tool_calls)."""
        return isinstance(self.tools, list) and bool(self.tools) and self.tool_choice != "none"


@dataclass(slots=True)
class ChatPlan:
    """How one chat request's reply is read, and the grammar of its calls."""

    prepared: PreparedChat | None = None  # None: not a chat (its text is the content)
    grammar: Grammar | None = None  # the tool calls' grammar, compiled

    @property
    def parse(self) -> bool:
        """Whether the reply is read at all: tool calls, or reasoning to extract."""
        p = self.prepared
        return p is not None and (p.format is not ToolFormat.CONTENT_ONLY or p.reasoning_format != "none")

    def stream_parser(self) -> ChatStreamParser:
        p = self.prepared
        return p.stream_parser() if p is not None else ChatStreamParser(ToolFormat.CONTENT_ONLY, "none")

    def parse_reply(self, text: str) -> ChatMessageOut:
        """A whole reply read into content, reasoning and calls."""
        p = self.prepared
        return p.parse(text) if p is not None else parse_chat_output(text, ToolFormat.CONTENT_ONLY)


def _thinking(body: dict[str, Any], kwargs: dict[str, object], default: bool) -> bool:
    """enable_thinking as llama-server reads it: chat_template_kwargs.enable_thinking, then
    reasoning_effort "none" (a thinking budget, even of 0, is the sampler's business)."""
    on = default
    v = kwargs.get("enable_thinking")
    if isinstance(v, str):
        raise bad_request('invalid type for "enable_thinking" (expected boolean, got string)')
    if isinstance(v, bool):
        on = v
    if body.get("reasoning_effort") == "none":
        on = False
    return on


def chat_request(body: dict[str, Any], jinja: bool, enable_thinking: bool) -> ChatRequest:
    """The tool and reasoning fields of an OpenAI chat body, with llama-server's refusals.
    `jinja` and `enable_thinking` are the server's (--jinja, -rea)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    has_tools = isinstance(tools, list) and bool(tools)
    if not jinja:
        if has_tools:
            raise bad_request("tools param requires --jinja flag")
        if choice not in (None, "auto"):
            raise bad_request("tool_choice param requires --jinja flag")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request(f"Field 'parallel_tool_calls': expected a boolean, got {type_name(parallel)}")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request(f"Field 'chat_template_kwargs': expected an object, got {type_name(kwargs)}")
    req = ChatRequest(
        tools if has_tools else None,
        choice,
        parallel,
        body.get("reasoning_format"),
        _thinking(body, kwargs or {}, enable_thinking),
        dict(kwargs or {}),
    )
    if req.calls_tools:
        if body.get("grammar") is not None:
            raise bad_request("Cannot use custom grammar constraints with tools.")
        if body.get("logprobs") and body.get("stream"):
            raise bad_request("logprobs is not supported with tools + stream")
    return req


def render_chat(
    template: ChatTemplate,
    msgs: Sequence[Mapping[str, object]],
    req: ChatRequest,
    add_gen: bool,
    default_reasoning_format: str,
    with_generation_prompt: bool = False,
) -> PreparedChat:
    """The prompt rendered with the request's tools and thinking switch, and its plan; a bad
    tools / tool_choice / reasoning_format is the client's 400. `with_generation_prompt`: a
    reasoning budget will need the generation prompt."""
    kwargs = {k: v for k, v in req.template_kwargs.items() if k != "enable_thinking"}
    try:
        return prepare_chat(
            template,
            msgs,
            tools=req.tools,
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel,
            reasoning_format=req.reasoning_format,
            default_reasoning_format=default_reasoning_format,
            enable_thinking=req.enable_thinking,
            chat_template_kwargs=kwargs or None,
            add_generation_prompt=add_gen,
            with_generation_prompt=with_generation_prompt,
        )
    except ToolRequestError as e:
        raise bad_request(str(e)) from None
    except WorkCancelled:
        raise
    except GrammarError as e:  # a tool's schema holds a pattern past the grammar budget
        raise sampler_error(e) from None


def chat_plan(prepared: PreparedChat, has_schema: bool) -> ChatPlan:
    """The plan of a rendered request. A request's own json_schema (response_format) wins over
    its tools, as in llama-server: its reply is content shaped by the schema, not calls. The
    tools' grammar is compiled through the server's grammar cache (the same tools tend to come
    back request after request); a lazy one shares the cached matcher."""
    if has_schema:
        prepared.format, prepared.grammar = ToolFormat.CONTENT_ONLY, None
    tg = prepared.grammar
    if tg is None:
        return ChatPlan(prepared)
    grammar = compile_request_grammar(tg.gbnf)
    if tg.lazy:
        try:
            grammar = grammar.with_triggers(tg.trigger_words, tg.trigger_patterns)
        except GrammarError as e:
            raise sampler_error(e) from None
    return ChatPlan(prepared, grammar)
