"""Hostile input against `ubatch server` on a real loopback port: lone UTF-16 surrogates in every
place text enters, huge n_probs / logprobs, out-of-range slot ids, and exceptions injected into
a request path. Each must end in llama-server's error JSON (400 for input, 500 for a bug) or a
bounded answer, with the slots released, /slots answering 200 and the next request served.
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

from ubatch.cli.server import responses as server_json
from ubatch.cli.server.app import ServerEngine, ServerOptions, create_app
from ubatch.engine.generation.generation import N_PROBS_MAX, Generation
from ubatch.engine.serve import runner


@pytest.fixture(scope="module")
def srv(tiny_gemma: Path) -> Iterator[tuple[str, ServerEngine]]:
    """-np 2 -c 512."""
    eng = start_server_engine(tiny_gemma, 2, 512)
    live = Live(create_app(eng, ServerOptions(alias="tiny")))
    yield live.url, eng
    live.close()
    eng.stop()


def post_raw(url: str, path: str, text: str | bytes) -> httpx.Response:
    """POST a body exactly as written: JSON escapes such as \\ud800 reach the server verbatim."""
    data = text.encode() if isinstance(text, str) else text
    return httpx.post(url + path, content=data, headers={"content-type": "application/json"}, timeout=60)


def stream_lines(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """Every `data:` event of a stream; raises if the server cuts the body short."""
    out: list[Any] = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def wait_idle(url: str) -> None:
    """/slots answers 200 until every slot is idle (a cancelled task is freed at the next
    iteration, so wait for it)."""
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(url + "/slots", timeout=30)
        assert r.status_code == 200, r.text
        if not any(s["is_processing"] for s in r.json()):
            break
        assert time.monotonic() < deadline, f"a slot stayed busy: {r.text[:300]}"
        time.sleep(0.02)


def assert_healthy(url: str) -> None:
    """Every slot idle, /slots answering 200, and a normal request served."""
    wait_idle(url)
    ok = httpx.post(url + "/completion", json={"prompt": "hello", "n_predict": 2, **GREEDY}, timeout=60)
    assert ok.status_code == 200 and ok.json()["tokens_predicted"] == 2


G = '"n_predict": 2, "temperature": 0'
SURROGATES = [  # path, body as JSON text, the field the error names
    ("/completion", '{"prompt": "a\\ud800b", %s}' % G, "prompt"),
    ("/completion", '{"prompt": "a\\ud800b", "stream": true, %s}' % G, "prompt"),
    ("/completion", '{"prompt": [2, "x\\udc00"], %s}' % G, "prompt[1]"),
    ("/completion", '{"prompt": ["ok", "\\ud83d"], %s}' % G, "prompt[1]"),
    ("/completion", '{"prompt": "hi", "stop": ["\\ud800"], "stream": true, %s}' % G, "stop[0]"),
    ("/completion", '{"prompt": "hi", "stop": "\\udfff", %s}' % G, "stop"),
    ("/completion", '{"prompt": "hi", "logit_bias": {"\\ud800": false}, %s}' % G, "logit_bias.\\ud800"),
    ("/completion", '{"prompt": "hi", "logit_bias": [["\\ud800", -1]], %s}' % G, "logit_bias[0][0]"),
    ("/completion", '{"prompt": "hi", "grammar": "root ::= \\"\\ud800\\"", %s}' % G, "grammar"),
    ("/completion", '{"prompt": "hi", "json_schema": {"const": "\\ud800"}, %s}' % G, "json_schema.const"),
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"], "stream": true, "max_tokens": 2}', "stop[0]"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}], "stream": true}',
        "messages[0].content[0].text",
    ),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud800", "content": "hi"}]}', "messages[0].role"),
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("/tokenize", '{"content": "\\ud800"}', "content"),
    ("/tokenize", '{"content": [1, "\\ud800"], "with_pieces": true}', "content[1]"),
    ("/detokenize", '{"tokens": [1], "note": "\\ud800"}', "note"),
    ("/apply-template", '{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages[0].content"),
]


@pytest.mark.parametrize("path,text,field", SURROGATES, ids=[f"{s[0]}-{s[2]}" for s in SURROGATES])
def test_lone_surrogate_is_a_400_naming_the_field(
    srv: tuple[str, ServerEngine], path: str, text: str, field: str
) -> None:
    url, _ = srv
    r = post_raw(url, path, text)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"]) == (400, "invalid_request_error")
    assert "lone UTF-16 surrogate" in err["message"] and f"'{field}'" in err["message"], err["message"]
    assert_healthy(url)


def test_valid_pairs_and_invalid_utf8(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    pair = post_raw(url, "/tokenize", '{"content": "\\ud83d\\ude00", "with_pieces": true}')  # U+1F600: fine
    assert pair.status_code == 200 and pair.json()["tokens"]
    done = post_raw(url, "/completion", '{"prompt": "\\ud83d\\ude00", %s}' % G)
    assert done.status_code == 200 and done.json()["tokens_predicted"] == 2
    for raw in (b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "\xff"}'):  # a surrogate in UTF-8 bytes; not UTF-8
        r = post_raw(url, "/completion", raw)
        assert r.status_code == 400 and "Invalid JSON" in r.json()["error"]["message"]
    assert_healthy(url)


# -- n_probs / logprobs --------------------------------------------------------------------------


def test_huge_n_probs_is_clamped_and_bounded(srv: tuple[str, ServerEngine]) -> None:
    url, sch = srv[0], srv[1].scheduler
    assert sch.vocab.n_tokens > N_PROBS_MAX  # so the clamp, not the vocabulary, is what bounds it
    body = {"prompt": "hi", "n_predict": 4, "n_probs": 10**6, **GREEDY}
    r = httpx.post(url + "/completion", json=body, timeout=60)
    assert r.status_code == 200 and len(r.content) < 1_000_000
    res = r.json()
    assert res["generation_settings"]["n_probs"] == N_PROBS_MAX
    probs = res["completion_probabilities"]
    assert len(probs) == 4 and all(len(p["top_logprobs"]) == N_PROBS_MAX for p in probs)
    assert all(p["id"] == p["top_logprobs"][0]["id"] for p in probs)  # greedy: the most probable first
    events = stream_lines(url, "/completion", {**body, "stream": True})
    assert all(len(e["completion_probabilities"][0]["top_logprobs"]) == N_PROBS_MAX for e in events[:-1])
    oai = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "logprobs": 10**6}, timeout=60)
    assert oai.status_code == 200 and len(oai.content) < 1_000_000
    content = oai.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == N_PROBS_MAX for c in content)
    assert_healthy(url)


def test_chat_top_logprobs_keeps_openai_limit(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    msgs = [{"role": "user", "content": "hi"}]
    big = {"messages": msgs, "max_tokens": 2, "logprobs": True, "top_logprobs": 10**6}
    r = httpx.post(url + "/v1/chat/completions", json=big, timeout=60)
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]
    ok = httpx.post(url + "/v1/chat/completions", json={**big, "top_logprobs": 20}, timeout=60)
    content = ok.json()["choices"][0]["logprobs"]["content"]
    assert ok.status_code == 200 and all(len(c["top_logprobs"]) == 20 for c in content)


# -- id_slot -------------------------------------------------------------------------------------


def test_id_slot_out_of_range_is_a_400(srv: tuple[str, ServerEngine]) -> None:
    url, _ = srv
    for bad in (99, 2, -2):
        r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 1, "id_slot": bad}, timeout=60)
        assert r.status_code == 400, r.text
        assert "'id_slot'" in r.json()["error"]["message"] and str(bad) in r.json()["error"]["message"]
    r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 1, "id_slot": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["id_slot"] == 1
    assert_healthy(url)


# -- exceptions inside a request path ------------------------------------------------------------


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected failure")


def test_exception_in_the_route_is_a_500_and_frees_the_slot(
    srv: tuple[str, ServerEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = srv
    monkeypatch.setattr(server_json, "native_final", _boom)  # after the task ran, while answering
    r = httpx.post(url + "/completion", json={"prompt": "hi", "n_predict": 3, **GREEDY}, timeout=60)
    assert r.status_code == 500
    err = r.json()["error"]
    assert (err["code"], err["type"]) == (500, "server_error") and "injected failure" in err["message"]
    monkeypatch.undo()
    assert_healthy(url)


def test_exception_mid_stream_ends_with_an_error_event(
    srv: tuple[str, ServerEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, sch = srv[0], srv[1].scheduler
    monkeypatch.setattr(server_json, "native_partial", _boom)
    events = stream_lines(url, "/completion", {"prompt": "hi", "n_predict": 200, "stream": True, **GREEDY})
    assert (
        len(events) == 1 and events[0]["error"]["code"] == 500 and "injected failure" in events[0]["error"]["message"]
    )
    wait_idle(url)
    assert sch.releases[-1].reason == "cancelled"  # freed at once, not after generating 200 tokens for nobody
    monkeypatch.setattr(server_json, "oai_chat_chunks", _boom)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True, **GREEDY}
    events = stream_lines(url, "/v1/chat/completions", chat)
    assert events[-1]["error"]["type"] == "server_error" and "[DONE]" not in events
    wait_idle(url)
    assert sch.releases[-1].reason == "cancelled"
    monkeypatch.undo()
    assert_healthy(url)


@pytest.mark.parametrize("stream", [False, True])
def test_exception_in_the_engine_fails_only_that_request(
    srv: tuple[str, ServerEngine], monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    url, _ = srv
    monkeypatch.setattr(Generation, "sample", _boom)
    monkeypatch.setattr(runner, "sample_rows", _boom)  # greedy rows are sampled together (engine/sampling/batched.py)
    body = {"prompt": "hi", "n_predict": 3, "stream": stream, **GREEDY}
    if stream:
        with httpx.stream("POST", url + "/completion", json=body, timeout=60) as r:
            text = r.read().decode()
        if r.status_code == 200:  # the failure came as the stream's first event
            err = json.loads(text.split("data: ", 1)[1])["error"]
        else:
            err = json.loads(text)["error"]
    else:
        r = httpx.post(url + "/completion", json=body, timeout=60)
        assert r.status_code == 500
        err = r.json()["error"]
    assert (err["code"], err["type"]) == (500, "server_error") and "injected failure" in err["message"]
    monkeypatch.undo()
    assert_healthy(url)


def test_huge_prompt_is_refused_before_tokenizing(srv: tuple[str, ServerEngine]) -> None:
    """A prompt that cannot fit is refused by its length: no token is longer than the vocabulary's
    longest, so its token count has a lower bound, and 4 MB never reach the tokenizer."""
    url, _ = srv
    r = httpx.post(url + "/completion", json={"prompt": "ab " * 1_400_000, "n_predict": 1}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 256 and err["n_prompt_tokens"] >= 256
    assert err["message"].startswith("request (at least ")
    assert_healthy(url)
