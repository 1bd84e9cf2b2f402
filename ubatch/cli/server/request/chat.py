"""Chat messages -> the prompt, as llama-server's oaicompat_chat_params_parse builds it for
/chat/completions, /apply-template and /chat/completions/input_tokens.

Beyond rendering the template this decides how the prompt ends:
* `add_generation_prompt` (default true): open the assistant's turn;
* a final assistant message (assistant prefill, on unless --no-prefill-assistant) or
  `continue_final_message`: the last message is not rendered as a closed turn; the prompt is the
  earlier messages with the assistant's turn opened, then that message's text, which the model
  continues. The reply's content then starts with that text, as llama-server's does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ubatch.cli.server.http import bad_request
from ubatch.cli.server.request.oai import chat_messages
from ubatch.cli.server.request.params import get_bool
from ubatch.cli.server.request.tools import ChatPlan, ChatRequest, chat_plan, chat_request, render_chat
from ubatch.cli.server.state import ServerState
from ubatch.engine.chat.tools import PreparedChat
from ubatch.engine.errors import EngineError, ErrorKind, UbatchError
from ubatch.engine.serve.task import context_error


@dataclass(slots=True)
class ChatPrompt:
    text: str  # the prompt
    prefill: str = ""  # the continued message's text: the start of the reply's content
    plan: ChatPlan = field(default_factory=ChatPlan)  # tools, reasoning: how the reply is read


def _continuation(v: Any) -> bool:
    """common_chat_continuation_parse: true, "content" or "reasoning_content" continue."""
    return v is True or v in ("content", "reasoning_content")


def _json_int(body: dict[str, Any], key: str, default: int) -> int:
    """llama.cpp's json_value for an integer: a number is taken (a float truncated), anything
    else (missing, null, another type) is the default."""
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return default
    return int(v)


def requested_budget(body: dict[str, Any], server: int) -> int:
    """The thinking budget a chat asks for: reasoning_budget_tokens, else thinking_budget_tokens
    (the Anthropic API's, mapped), else (-1) the server's --reasoning-budget."""
    budget = _json_int(body, "reasoning_budget_tokens", _json_int(body, "thinking_budget_tokens", -1))
    return server if budget == -1 else budget


def chat_prompt(st: ServerState, body: dict[str, Any]) -> ChatPrompt:
    """The prompt for an OpenAI chat body (already checked by oai_chat_body). Like llama-server's
    oaicompat_chat_params_parse it also writes into `body` the native fields the chat implies:
    the reasoning budget with the template's thinking tags, and the generation prompt."""
    assert st.chat is not None
    o = st.options
    # every template spends a token or more on each message: a conversation of more messages than
    # the context has cells is refused before rendering (millions of tiny messages took minutes)
    if (err := context_error(len(body["messages"]), st.handle().n_ctx_slot, at_least=True)) is not None:
        raise err
    req = chat_request(body, o.jinja, o.enable_thinking)
    budget = requested_budget(body, o.reasoning_budget)
    msgs = chat_messages(body["messages"])
    add_gen = get_bool(body, "add_generation_prompt", True)
    cont = _continuation(body.get("continue_final_message"))
    if not cont and st.options.prefill_assistant and msgs and msgs[-1]["role"] == "assistant":
        if len(msgs) >= 2 and msgs[-2]["role"] == "assistant":
            raise bad_request("Cannot have 2 or more assistant messages at the end of the list.")
        cont, add_gen = True, False
    if cont and add_gen:
        raise bad_request("Cannot set both add_generation_prompt and continue_final_message to true.")
    if cont and msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
        raise bad_request("Cannot continue an assistant message that contains tool calls.")
    # a template that rejects these messages raises a ChatTemplateError: the client's 400
    if not cont:
        prepared, prefill = _render(st, msgs, add_gen, req, budget >= 0), ""
    else:
        prefill = msgs[-1]["content"] if msgs else ""
        prepared = _render(st, msgs[:-1], True, req, budget >= 0)
    plan = chat_plan(prepared, body.get("json_schema") is not None)
    if prepared.thinking_end_tags:  # the template thinks: a budget has tags to watch for
        message = body.get("reasoning_budget_message")
        body["reasoning_budget_tokens"] = budget
        body["reasoning_budget_start_tag"] = prepared.thinking_start_tag
        body["reasoning_budget_end_tags"] = list(prepared.thinking_end_tags)
        body["reasoning_budget_message"] = message if isinstance(message, str) else o.reasoning_budget_message
    body["generation_prompt"] = prepared.generation_prompt
    return ChatPrompt(prepared.prompt + prefill, prefill, plan)


def _render(
    st: ServerState, msgs: list[dict[str, Any]], add_gen: bool, req: ChatRequest, with_gen: bool
) -> PreparedChat:
    """The template applied; any other failure of it (a bug in a template) is a 500 naming the
    template, for this request only. `with_gen`: find the generation prompt too."""
    assert st.chat is not None
    try:
        return render_chat(st.chat, msgs, req, add_gen, st.options.reasoning_format, with_gen)
    except (UbatchError, RecursionError):
        raise
    except Exception as e:
        raise EngineError(
            ErrorKind.INTERNAL, f"chat template {st.chat.describe} failed to render: {type(e).__name__}: {e}"
        ) from None
