"""`ubatch server`'s request side against llama-server's: prompts as strings, token ids, mixtures
and lists of prompts; /tokenize's mixed content; /apply-template, assistant prefill and the
chat token count; prompt_progress events; __verbose; resumable streams (X-Conversation-Id,
/v1/stream); /infill; and the answers for the features this server lacks. Real loopback servers
on a tiny model (greedy, so a prompt's continuation is reproducible).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import GREEDY, Live, start_server_engine

from ubatch.cli.server.app import ServerEngine, ServerOptions, create_app
from ubatch.cli.server.run import start_engine
from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.serve.scheduler import Scheduler

CHAT = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def srv(tiny_gemma: Path) -> Iterator[tuple[str, ServerEngine]]:
    """-np 2 -c 512 -b 16: a 60-token prompt takes four decodes."""
    ctx = Context(
        Model.load(tiny_gemma), ContextParams(n_ctx=512, n_seq_max=2, n_outputs_max=2, n_batch=16, n_ubatch=16)
    )
    eng = start_engine(Scheduler(ctx, 2))
    live = Live(create_app(eng, ServerOptions(alias="tiny")))
    yield live.url, eng
    live.close()
    eng.stop()


def post(url: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kw)


def events(url: str, path: str, body: dict[str, Any], **kw: Any) -> list[Any]:
    with httpx.stream("POST", url + path, json=body, timeout=60, **kw) as r:
        assert r.status_code == 200 and r.headers["x-accel-buffering"] == "no"
        return [x[6:] if x == "data: [DONE]" else json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]


def tokens(url: str, content: Any, add_special: bool = True) -> list[int]:
    return post(url, "/tokenize", {"content": content, "add_special": add_special}).json()["tokens"]


def cmpl(url: str, prompt: Any, n: int = 4) -> Any:
    r = post(url, "/completion", {"prompt": prompt, "n_predict": n, **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def test_prompts_as_strings_token_ids_mixtures_and_lists(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    text = cmpl(url, "hello world")["content"]
    ids = tokens(url, "hello world")  # with BOS, as the string prompt is tokenized
    assert cmpl(url, ids)["content"] == text
    assert cmpl(url, {"prompt_string": "hello world"})["content"] == text
    mixed = [ids[0], *tokens(url, "hello", False), " world"]  # ids, then text: no second BOS
    assert cmpl(url, mixed)["tokens_evaluated"] == len(ids) and cmpl(url, mixed)["content"] == text
    many = cmpl(url, ["hello world", ids, [ids[0], " the"], {"prompt_string": "a b"}])
    assert [m["index"] for m in many] == [0, 1, 2, 3] and many[0]["content"] == many[1]["content"] == text
    oai = post(url, "/v1/completions", {"prompt": ["hello world", ids], "max_tokens": 4, **GREEDY}).json()
    assert [c["text"] for c in oai["choices"]] == [text, text]
    assert cmpl(url, [[]])["tokens_evaluated"] == 0  # one empty prompt: answered at once
    for bad in ([], [1, [2]], [1.5], ["a", 2.5], [["a", "b"]], {"x": 1}):
        r = post(url, "/completion", {"prompt": bad, "n_predict": 1})
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"], bad


def test_tokenize_mixed_content(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    a, b = tokens(url, "a"), tokens(url, "b", False)
    assert tokens(url, ["a", "b"]) == a + b and tokens(url, [5, "a"]) == [5, *tokens(url, "a", False)]
    assert tokens(url, []) == [] and post(url, "/tokenize", {"content": [["a"]]}).status_code == 400


def test_apply_template_prefill_and_input_tokens(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    head = post(url, "/apply-template", {"messages": CHAT}).json()["prompt"]
    assert head.endswith("<start_of_turn>model\n")
    closed = post(url, "/apply-template", {"messages": CHAT, "add_generation_prompt": False}).json()["prompt"]
    assert closed == head[: -len("<start_of_turn>model\n")]
    prefill = [*CHAT, {"role": "assistant", "content": "the world"}]
    prompt = post(url, "/apply-template", {"messages": prefill}).json()["prompt"]
    assert prompt == head + "the world"  # the assistant's turn is continued, not closed
    body = {"messages": prefill, "max_tokens": 4, **GREEDY}
    r = post(url, "/v1/chat/completions", body).json()
    assert r["choices"][0]["message"]["content"] == "the world" + cmpl(url, prompt)["content"]
    streamed = events(url, "/v1/chat/completions", {**body, "stream": True})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed[:-1] if e["choices"])
    assert text == r["choices"][0]["message"]["content"]
    n = post(url, "/v1/chat/completions/input_tokens", {"messages": prefill}).json()
    assert n == {"input_tokens": len(tokens(url, prompt)), "object": "response.input_tokens"}
    assert post(url, "/chat/completions/input_tokens", {"messages": prefill}).json() == n
    two = [*prefill, {"role": "assistant", "content": "x"}]
    for bad, why in (
        ({"messages": two}, "Cannot have 2 or more assistant messages"),
        ({"messages": CHAT, "continue_final_message": True}, "Cannot set both"),
    ):
        r = post(url, "/apply-template", bad)
        assert r.status_code == 400 and why in r.json()["error"]["message"]
    cont = {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False}
    assert post(url, "/apply-template", cont).json()["prompt"].endswith("model\nhello world")


LONG = "the world " * 30  # 61 tokens with BOS


def test_prompt_progress_events(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    body = {"prompt": LONG, "n_predict": 2, "stream": True, "return_progress": True, "cache_prompt": False, **GREEDY}
    evs = events(url, "/completion", body)
    prog = [e["prompt_progress"] for e in evs if "prompt_progress" in e]
    total = len(tokens(url, LONG))
    assert [p["processed"] for p in prog] == [0, 16, 32, 48, total]  # at the start, then per decode
    assert all(p["total"] == total and p["cache"] == 0 for p in prog)
    first_token = next(i for i, e in enumerate(evs) if e.get("content"))
    assert all("prompt_progress" in e for e in evs[: len(prog)]) and first_token == len(prog)
    assert not any("prompt_progress" in e for e in events(url, "/completion", {**body, "return_progress": False}))
    chat = events(
        url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True, "return_progress": True}
    )
    p = [e for e in chat if isinstance(e, dict) and "prompt_progress" in e]
    assert p and all(e["choices"][0]["delta"] == {"role": "assistant", "content": None} for e in p)
    assert p[-1]["prompt_progress"]["processed"] == p[-1]["prompt_progress"]["total"]


def test_verbose(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    r = post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "verbose": True, **GREEDY}).json()
    v = r["__verbose"]
    assert v["content"] == r["choices"][0]["text"] and v["tokens_predicted"] == 3 and "generation_settings" in v
    chat = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "verbose": True}).json()
    assert chat["__verbose"]["stop"] is True
    assert "__verbose" not in post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 1}).json()


def test_resumable_stream(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    conv = "conv-1::org/model"
    qs = {"conv_id": conv}
    body = {"messages": CHAT, "max_tokens": 6, "stream": True, **GREEDY}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conv}) as r:
        raw = b"".join(r.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n")
    assert httpx.get(url + "/v1/stream", params={**qs, "from": 0}).content == raw
    assert httpx.get(url + "/v1/stream", params={**qs, "from": 10}).content == raw[10:]
    (info,) = post(url, "/v1/streams/lookup", {"conversation_ids": ["conv-1", "other"]}).json()
    assert info["conversation_id"] == conv and info["is_done"] and info["total_bytes"] == len(raw)
    # a client that leaves mid-stream: the generation goes on and can be read again
    long = {**body, "max_tokens": 40}
    with httpx.stream("POST", url + "/v1/chat/completions", json=long, headers={"X-Conversation-Id": conv}) as r:
        next(r.iter_lines())
    deadline = time.time() + 30
    while not post(url, "/v1/streams/lookup", {"conversation_ids": [conv]}).json()[0]["is_done"]:
        assert time.time() < deadline
        time.sleep(0.05)
    replay = [x for x in httpx.get(url + "/v1/stream", params=qs).text.splitlines() if x.startswith("data: ")]
    last = json.loads(replay[-2][6:])
    assert replay[-1] == "data: [DONE]" and last["timings"]["predicted_n"] == 40
    assert last["choices"][0]["finish_reason"] == "length"
    assert httpx.delete(url + "/v1/stream", params=qs).status_code == 204
    assert httpx.get(url + "/v1/stream", params=qs).status_code == 404
    assert httpx.get(url + "/v1/stream").status_code == 400 and httpx.delete(url + "/v1/stream").status_code == 400


def test_stop_cancels_a_detached_stream(srv: tuple[str, ServerEngine]) -> None:
    url, sch = srv[0], srv[1].scheduler
    body = {"prompt": "hello", "n_predict": 400, "stream": True, **GREEDY}
    with httpx.stream("POST", url + "/completion", json=body, headers={"X-Conversation-Id": "c2"}) as r:
        next(r.iter_lines())
    assert any(s.busy for s in sch.slots)
    assert httpx.delete(url + "/v1/stream", params={"conv_id": "c2"}).status_code == 204
    deadline = time.time() + 30
    while any(s.busy for s in sch.slots):
        assert time.time() < deadline
        time.sleep(0.02)
    assert (
        sch.releases[-1].reason == "cancelled"
        and post(url, "/v1/streams/lookup", {"conversation_ids": ["c2"]}).json() == []
    )


def test_features_this_server_lacks(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    assert httpx.get(url + "/lora-adapters").json() == [] and post(url, "/lora-adapters", []).json() == {
        "success": True
    }
    for method, path, code in (
        ("POST", "/slots/0?action=save", 501),
        ("GET", "/tools", 403),
        ("POST", "/cors-proxy", 403),
        ("POST", "/v1/audio/transcriptions", 501),
        ("POST", "/v1/systemone", 501),
        ("POST", "/infill", 501),  # the tiny vocabulary has no FIM tokens
    ):
        r = httpx.request(method, url + path, json={})
        assert r.status_code == code and "error" in r.json(), path
    ctl = post(url, "/v1/chat/completions/control", {"id": "chatcmpl-x", "action": "reasoning_end"}).json()
    assert ctl == {"success": False, "message": "no active completion for this id"}
    assert post(url, "/v1/chat/completions/control", {"id": "x"}).status_code == 400


def test_infill(tmp_path: Path) -> None:
    """A vocabulary with FIM tokens: [BOS][FIM_PRE]prefix prompt[FIM_SUF]suffix[FIM_MID]."""
    from tiny_models import TinySpec, write_tiny_model
    from tiny_vocab import piece_id

    pre, suf, mid = piece_id("<"), piece_id(">"), piece_id("/")

    def fim(w: Any, rng: Any) -> None:
        for name, tok in (("pre", pre), ("suf", suf), ("mid", mid)):
            w.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", tok)

    eng = start_server_engine(write_tiny_model(tmp_path / "fim.gguf", TinySpec(extra=fim)), 1, 256)
    live = Live(create_app(eng))
    try:
        url = live.url
        body = {"input_prefix": "hello", "input_suffix": "world", "prompt": " the", "n_predict": 3, **GREEDY}
        r = post(url, "/infill", body).json()
        t = [2, pre, *tokens(url, "hello", False), *tokens(url, " the", False), suf, *tokens(url, "world", False), mid]
        assert r["tokens_evaluated"] == len(t) and r["content"] == cmpl(url, t, 3)["content"]
        assert post(url, "/infill", {"input_prefix": "x"}).status_code == 400
    finally:
        live.close()
        eng.stop()
