"""llama-server's preserved_tokens: a chat format's markers (`<tool_call>`, `[TOOL_CALLS]`,
`<think>`) are control tokens in some vocabularies, hidden from the text without -sp; the reply's
parser must still see them, so exactly those tokens' text is shown. Checked on a tiny model whose
vocabulary has `<tool_call>` / `</tool_call>` as control tokens, through a real loopback server:
the native body's `preserved_tokens`, and a chat whose tools' format preserves its markers (a
logit bias makes the model pick the control tokens wherever the grammar allows them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import Live, start_server_engine
from test_server_tools import QWEN25, TOOLS, template_file
from tiny_models import TinySpec, write_tiny_model
from tiny_vocab import CONTROL, tiny_spm_vocab

from ubatch.cli.server.app import ServerOptions, create_app
from ubatch.engine.generation.generation import GenerationParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, int]]:
    """A server on a tiny model with <tool_call> and </tool_call> as control tokens, Qwen 2.5's
    template (the Hermes format); the url and the two tokens' ids."""
    tokens, scores, types = tiny_spm_vocab()
    ids = len(tokens), len(tokens) + 1
    vocab = ([*tokens, OPEN, CLOSE], [*scores, -1000.0, -1000.0], [*types, CONTROL, CONTROL])
    tmp = tmp_path_factory.mktemp("preserved")
    path = write_tiny_model(tmp / "tiny-control-tool-call.gguf", TinySpec(vocab=vocab))
    eng = start_server_engine(path, 1, 4096)
    live = Live(create_app(eng, ServerOptions(alias="tiny", chat_template=template_file(tmp, "q.jinja", QWEN25))))
    yield live.url, *ids
    live.close()
    eng.stop()


def test_the_default_preserves_nothing() -> None:
    assert GenerationParams().preserved == frozenset()


def test_native_body_preserved_tokens(server: tuple[str, int, int]) -> None:
    url, open_id, _ = server
    body: dict[str, Any] = {"prompt": "hello", "n_predict": 2, "temperature": 0, "logit_bias": [[open_id, 100]]}
    hidden = httpx.post(url + "/completion", json=body, timeout=60).json()
    assert hidden["content"] == "" and hidden["tokens_predicted"] == 2  # a control token: hidden
    shown = httpx.post(url + "/completion", json={**body, "preserved_tokens": [OPEN, "not one token"]}, timeout=60)
    assert shown.json()["content"] == OPEN * 2
    bad = httpx.post(url + "/completion", json={**body, "preserved_tokens": OPEN}, timeout=60)
    assert bad.status_code == 400 and "preserved_tokens" in bad.text


def test_chat_tool_call_markers_reach_the_parser(server: tuple[str, int, int]) -> None:
    """The grammar makes the call; the bias makes it with the control tokens, which the parser
    sees only because the Hermes format preserves them."""
    url, open_id, close_id = server
    body = {
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 400,
        "logit_bias": {str(open_id): 100, str(close_id): 100},
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    msg = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "tool_calls", msg
    assert msg["content"] == "" and len(msg["tool_calls"]) == 1
    assert msg["tool_calls"][0]["function"]["name"] in ("get_weather", "get_time")
    raw = httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 2}, timeout=60)
    assert raw.json()["choices"][0]["message"]["content"] == ""  # no tools in use: nothing preserved
