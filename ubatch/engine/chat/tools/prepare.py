"""A chat request made ready to generate: the prompt rendered with its tools, the format its
answer will be parsed in, the grammar (lazy or not) and the reasoning settings, in one place a
server route calls (llama.cpp's common_chat_templates_apply)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ubatch.engine.chat.tools import formats as F
from ubatch.engine.chat.tools import harmony as H
from ubatch.engine.chat.tools import parse_tagged as T
from ubatch.engine.chat.tools.formats import ToolFormat, detect_tool_format, supports_thinking
from ubatch.engine.chat.tools.grammar import ToolGrammar, build_tool_grammar
from ubatch.engine.chat.tools.parse import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_TAG,
    PYTHON_TAG,
    THINK_CLOSE,
    THINK_OPEN,
    parse_chat_output,
)
from ubatch.engine.chat.tools.request import parse_reasoning_format, parse_tool_choice, parse_tools
from ubatch.engine.chat.tools.stream import ChatStreamParser
from ubatch.engine.chat.tools.types import ChatMessageOut, Tool, ToolChoice

if TYPE_CHECKING:
    from ubatch.engine.chat.template import ChatTemplate
    from ubatch.engine.grammar import Grammar

# Tokens the answer's parser must see as text even where control tokens are hidden
# (llama-server's preserved_tokens): the format's markers.
_PRESERVED: dict[ToolFormat, tuple[str, ...]] = {
    ToolFormat.HERMES: (HERMES_OPEN, HERMES_CLOSE),
    ToolFormat.LLAMA3: (PYTHON_TAG,),
    ToolFormat.MISTRAL_NEMO: (MISTRAL_TAG,),
    ToolFormat.DEEPSEEK_R1: (F.DS_CALLS_BEGIN, F.DS_CALLS_END, F.DS_CALL_BEGIN, F.DS_CALL_END, F.DS_SEP),
    ToolFormat.FUNCTIONARY_V3_2: (T.RECIPIENT + T.ALL,),
    ToolFormat.QWEN3_CODER: (T.CALL_OPEN, T.CALL_CLOSE),
    ToolFormat.GPT_OSS: (H.CHANNEL, H.CONSTRAIN, H.MESSAGE, "<|start|>", H.END),
}


@dataclass(slots=True)
class PreparedChat:
    """What generating and answering one chat request needs."""

    prompt: str
    format: ToolFormat
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = False
    grammar: ToolGrammar | None = None
    reasoning_format: str = "auto"
    thinking_forced_open: bool = False  # the prompt ends inside <think>: the answer starts thinking
    preserved_tokens: tuple[str, ...] = ()  # generate these as text (the parser needs them)
    # the template's thinking tags (none: it does not think), what a reasoning budget watches for
    thinking_start_tag: str = ""
    thinking_end_tags: tuple[str, ...] = ()
    # what add_generation_prompt adds to the prompt (the assistant's header, an opened <think>),
    # computed when asked for: a reasoning budget is primed with it
    generation_prompt: str = ""

    def compile_grammar(self, tokenize: Callable[[str], list[int]] | None = None) -> Grammar | None:
        """The compiled grammar (lazy ones carry their triggers), or None."""
        return self.grammar.compile(tokenize) if self.grammar is not None else None

    def parse(self, text: str) -> ChatMessageOut:
        """The whole generated text parsed (a non-streaming answer)."""
        return parse_chat_output(
            text,
            self.format,
            reasoning_format=self.reasoning_format,
            thinking_forced_open=self.thinking_forced_open,
            tools=self.callable_tools,
        )

    @property
    def callable_tools(self) -> list[Tool]:
        """The tools a call may name (none with tool_choice none, though the template saw them)."""
        return self.tools if self.tool_choice.mode != "none" else []

    def stream_parser(self) -> ChatStreamParser:
        """A parser for a streamed answer (feed it each piece of text)."""
        return ChatStreamParser(self.format, self.reasoning_format, self.thinking_forced_open, self.callable_tools)


def _args_object(args: object) -> object:
    """Arguments as the templates want them: an object (llama.cpp parses the JSON string)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _template_messages(messages: Sequence[Mapping[str, object]], object_args: bool = True) -> list[dict[str, object]]:
    """The messages as llama.cpp hands them to a Jinja template: tool calls' arguments as
    objects (unless the template writes them as strings, as Functionary's concatenates them),
    null content as "" where calls are."""
    out = []
    for m in messages:
        d = dict(m)
        calls = d.get("tool_calls")
        if isinstance(calls, Sequence) and not isinstance(calls, str):
            fixed = []
            for c in calls:
                if isinstance(c, Mapping):
                    c = dict(c)
                    fn = c.get("function")
                    if isinstance(fn, Mapping) and object_args:
                        c["function"] = {**fn, "arguments": _args_object(fn.get("arguments"))}
                fixed.append(c)
            d["tool_calls"] = fixed
            if d.get("content") is None:
                d["content"] = ""
        out.append(d)
    return out


def _generic_instructions(tools: Sequence[Tool], parallel: bool, required: bool) -> str:
    call = '{"name": <tool name>, "arguments": <arguments object>}'
    how = f'{{"tool_calls": [{call}, ...]}}' if parallel else f'{{"tool_call": {call}}}'
    lines = ["You can call the following tools:"]
    lines += [json.dumps(t.to_openai()["function"], ensure_ascii=False) for t in tools]
    lines.append("")
    if required:
        lines.append(f"Answer with one JSON object that calls a tool: {how}")
    else:
        lines.append(f'Answer with one JSON object: {how} to call a tool, or {{"response": <your answer>}}.')
    return "\n".join(lines)


def _generic_history(messages: list[dict[str, object]], source: str) -> list[dict[str, object]]:
    """Calls and tool results as text, for templates that know neither (the JSON the grammar
    has the model write, and {"tool_response": ...} as a user turn)."""
    if "tool_calls" in source:
        return messages
    names: dict[str, str] = {}
    out: list[dict[str, object]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list) and calls:
            items = []
            for c in calls:
                fn = c.get("function") if isinstance(c, Mapping) else None
                if isinstance(fn, Mapping):
                    items.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
                    if isinstance(c, Mapping) and isinstance(c.get("id"), str):
                        names[str(c["id"])] = str(fn.get("name"))
            body: dict[str, object] = (
                {"tool_calls": items} if len(items) > 1 else {"tool_call": items[0] if items else {}}
            )
            out.append({"role": "assistant", "content": json.dumps(body, ensure_ascii=False)})
        elif m.get("role") == "tool":
            name = names.get(str(m.get("tool_call_id")), m.get("name") or "")
            resp = {"tool_response": {"tool": name, "content": m.get("content")}}
            out.append({"role": "user", "content": json.dumps(resp, ensure_ascii=False)})
        else:
            out.append(m)
    return out


def _add_system(messages: list[dict[str, object]], text: str, source: str) -> list[dict[str, object]]:
    """Put `text` in the system message (or, for templates with no system role, the first user
    message, as llama.cpp's workaround does)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content")
        merged = (content + "\n\n" if isinstance(content, str) and content else "") + text
        return [{**first, "content": merged}, *messages[1:]]
    if "System role not supported" in source:
        for i, m in enumerate(messages):
            if m.get("role") == "user":
                content = m.get("content")
                merged = text + ("\n\n" + content if isinstance(content, str) else "")
                return [*messages[:i], {**m, "content": merged}, *messages[i + 1 :]]
    return [{"role": "system", "content": text}, *messages]


def prepare_chat(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, object]],
    *,
    tools: object = None,
    tool_choice: object = None,
    parallel_tool_calls: bool = False,
    reasoning_format: object = None,
    default_reasoning_format: str = "auto",
    enable_thinking: bool = True,
    chat_template_kwargs: Mapping[str, object] | None = None,
    add_generation_prompt: bool = True,
    with_generation_prompt: bool = False,
) -> PreparedChat:
    """Render and plan one chat request. `tools` / `tool_choice` / `reasoning_format` are the
    request's JSON values (or parsed Tools / a ToolChoice); ToolRequestError for bad ones,
    ChatTemplateError from the template. `enable_thinking=False` (-rea off) tells the template
    so, as llama-server does. `with_generation_prompt`: also find the generation prompt (the
    template rendered once more, or twice without add_generation_prompt)."""
    tool_list = (
        list(tools) if isinstance(tools, list) and all(isinstance(t, Tool) for t in tools) else parse_tools(tools)
    )
    choice = tool_choice if isinstance(tool_choice, ToolChoice) else parse_tool_choice(tool_choice, tool_list)
    rfmt = parse_reasoning_format(reasoning_format, default_reasoning_format)
    source = template.source or ""
    use_tools = bool(tool_list) and choice.mode != "none"
    family = detect_tool_format(template.source)
    harmony = family is ToolFormat.GPT_OSS  # its channels carry the reasoning, tools or not
    fmt = family if use_tools or harmony else ToolFormat.CONTENT_ONLY
    msgs = _template_messages(messages, object_args=family is not ToolFormat.FUNCTIONARY_V3_2)
    if harmony:
        msgs = _harmony_history(msgs)
    if fmt is ToolFormat.GENERIC:
        msgs = _generic_history(msgs, source)
        msgs = _add_system(
            msgs, _generic_instructions(tool_list, parallel_tool_calls, choice.mode == "required"), source
        )
    extra: dict[str, object] = {"enable_thinking": enable_thinking}
    if chat_template_kwargs:
        extra.update(chat_template_kwargs)
    thinking_ok = bool(extra.get("enable_thinking", True))
    # tool_choice "none" still shows the template the tools (llama.cpp does: the prompt and its
    # token count match llama-server's); only the grammar and the call parsing are left out.
    openai_tools = [t.to_openai() for t in tool_list] if tool_list else None
    prompt = template.apply(msgs, add_generation_prompt, tools=openai_tools, extra_context=extra)
    forced_open = rfmt != "none" and add_generation_prompt and prompt.rstrip().endswith(THINK_OPEN)
    thinking = supports_thinking(template.source) and thinking_ok and rfmt != "none"
    grammar = None
    if use_tools:
        grammar = build_tool_grammar(
            tool_list,
            choice,
            fmt,
            parallel=parallel_tool_calls,
            thinking=thinking or forced_open,
            thinking_forced_open=forced_open,
        )
    preserved = _PRESERVED.get(fmt, ())
    thinks = supports_thinking(template.source)
    if thinks:
        preserved += (THINK_OPEN, THINK_CLOSE)
    out = PreparedChat(prompt, fmt, tool_list, choice, parallel_tool_calls, grammar, rfmt, forced_open, preserved)
    if thinks or forced_open:
        out.thinking_start_tag, out.thinking_end_tags = THINK_OPEN, _thinking_end_tags(source, family)
    if harmony:
        out.thinking_start_tag, out.thinking_end_tags = H.ANALYSIS, (H.END,)
    if with_generation_prompt:
        with_gen = (
            prompt if add_generation_prompt else template.apply(msgs, True, tools=openai_tools, extra_context=extra)
        )
        out.generation_prompt = generation_suffix(
            template.apply(msgs, False, tools=openai_tools, extra_context=extra), with_gen
        )
    return out


def _harmony_history(messages: list[dict[str, object]]) -> list[dict[str, object]]:
    """GPT-OSS's template reads an assistant's reasoning from `thinking`, and refuses content
    beside it in a message with calls (llama.cpp moves it the same way)."""
    out = []
    for m in messages:
        if isinstance(m.get("reasoning_content"), str):
            m = {**m, "thinking": m["reasoning_content"]}
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out


def _thinking_end_tags(source: str, family: ToolFormat) -> tuple[str, ...]:
    """The end tags a reasoning budget watches for, the forced one first: a template that writes
    a newline before `</think>` (Qwen 3's '\\n</think>\\n\\n') is closed the way it writes it, as
    llama.cpp's template analysis finds; the bare tag still ends the block when the model writes
    it, and in Qwen3-Coder's format (Qwen 3.5) so does a call, as llama.cpp's parser for it has."""
    if family is ToolFormat.QWEN3_CODER:
        return ("\n" + THINK_CLOSE, THINK_CLOSE, T.CALL_OPEN)
    if "\\n" + THINK_CLOSE in source or "\n" + THINK_CLOSE in source:
        return ("\n" + THINK_CLOSE, THINK_CLOSE)
    return (THINK_CLOSE,)


def generation_suffix(without: str, with_gen: str) -> str:
    """What the generation prompt adds: the rendering with it past the common prefix of both
    (common_chat_template_generation_prompt)."""
    n = 0
    for a, b in zip(without, with_gen):
        if a != b:
            break
        n += 1
    return with_gen[n:]
