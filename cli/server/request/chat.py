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

from dataclasses import dataclass, field
from typing import Any

from ubatch.cli.server.http import bad_request
from ubatch.cli.server.request.oai import chat_messages
from ubatch.cli.server.request.params import get_bool
from ubatch.cli.server.request.tools import ChatPlan, ChatRequest, chat_plan, chat_request, render_chat
from ubatch.cli.server.state import ServerState
from ubatch.engine.chat.tools import PreparedChat
from ubatch.engine.errors import EngineError, ErrorKind, UbatchError


@dataclass(slots=True)
class ChatPrompt:
    text: str  # the prompt
    prefill: str = ""  # the continued message's text: the start of the reply's content
    plan: ChatPlan = field(default_factory=ChatPlan)  # tools, reasoning: how the reply is read


def _continuation(v: Any) -> bool:
    """common_chat_continuation_parse: true, "content" or "reasoning_content" continue."""
    return v is True or v in ("content", "reasoning_content")


def chat_prompt(st: ServerState, body: dict[str, Any]) -> ChatPrompt:
    """The prompt for an OpenAI chat body (already checked by oai_chat_body)."""
    assert st.chat is not None
    o = st.options
    req = chat_request(body, o.jinja, o.enable_thinking)
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
        prepared, prefill = _render(st, msgs, add_gen, req), ""
    else:
        prefill = msgs[-1]["content"] if msgs else ""
        prepared = _render(st, msgs[:-1], True, req)
    plan = chat_plan(prepared, body.get("json_schema") is not None)
    return ChatPrompt(prepared.prompt + prefill, prefill, plan)


def _render(st: ServerState, msgs: list[dict[str, Any]], add_gen: bool, req: ChatRequest) -> PreparedChat:
    """The template applied; any other failure of it (a bug in a template) is a 500 naming the
    template, for this request only."""
    assert st.chat is not None
    try:
        return render_chat(st.chat, msgs, req, add_gen, st.options.reasoning_format)
    except (UbatchError, RecursionError):
        raise
    except Exception as e:
        raise EngineError(
            ErrorKind.INTERNAL, f"chat template {st.chat.describe} failed to render: {type(e).__name__}: {e}"
        ) from None
