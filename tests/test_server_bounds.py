"""Bodies whose cost grows with the count of their elements, not their bytes, are refused by count
before the work: more prompts than one request may carry, more messages than the context has
cells (each message takes at least one token), more logit_bias entries than the vocabulary has
tokens or 65536. A 64 MiB body of tiny elements used to cost from 13 s to minutes of CPU before
its answer (millions of tasks, a template rendered over millions of messages); each is now a 400
in about the time JSON takes to parse it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import Live, start_server_engine

from ubatch.cli.server.app import ServerEngine, ServerOptions, create_app
from ubatch.cli.server.request.params import MAX_LOGIT_BIAS, MAX_PROMPTS

N_CTX = 512  # one slot


@pytest.fixture(scope="module")
def url(tiny_gemma: Path) -> Iterator[str]:
    eng: ServerEngine = start_server_engine(tiny_gemma, 1, N_CTX)
    live = Live(create_app(eng, ServerOptions()))
    yield live.url
    live.close()
    eng.stop()


def post(url: str, route: str, body: object) -> tuple[httpx.Response, float]:
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    r = httpx.post(url + route, content=data, headers={"Content-Type": "application/json"}, timeout=120)
    return r, time.perf_counter() - t0


def test_prompts_beyond_the_limit_are_one_400(url: str) -> None:
    r, _ = post(url, "/completion", {"prompt": ["ab"] * MAX_PROMPTS, "n_predict": 0})
    assert r.status_code == 200 and len(r.json()) == MAX_PROMPTS  # the limit itself is served
    for route, field in (("/completion", "prompt"), ("/v1/completions", "prompt")):
        r, _ = post(url, route, {field: ["ab"] * (MAX_PROMPTS + 1), "max_tokens": 1})
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and f"holds {MAX_PROMPTS + 1} prompts, more than {MAX_PROMPTS}" in msg, msg
    r, took = post(url, "/completion", {"prompt": ["ab"] * 2_000_000, "n_predict": 1})  # 12 MiB of prompts
    assert r.status_code == 400 and took < 60, took  # a hang guard: it was minutes of tasks


def test_more_messages_than_the_context_holds_is_the_context_error(url: str) -> None:
    msgs = [{"role": "user", "content": "hi"}] * (N_CTX + 1)
    for route in ("/v1/chat/completions", "/v1/messages"):
        r, _ = post(url, route, {"messages": msgs, "max_tokens": 1})
        err = r.json()["error"]
        assert r.status_code == 400, r.text
        assert (
            f"at least {N_CTX + 1} tokens" in err["message"] and "exceeds the available context size" in err["message"]
        )
    r, took = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 300_000})
    assert r.status_code == 400 and took < 60, took  # rendered whole, this was seconds per 100k messages


def test_logit_bias_entries_beyond_the_bound_are_a_400(url: str) -> None:
    n_vocab = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["meta"]["n_vocab"]
    cap = max(n_vocab, MAX_LOGIT_BIAS)
    ok, _ = post(url, "/completion", {"prompt": "x", "n_predict": 1, "logit_bias": [[1, -1.0]] * cap})
    assert ok.status_code == 200
    r, _ = post(url, "/completion", {"prompt": "x", "n_predict": 1, "logit_bias": [[1, -1.0]] * (cap + 1)})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and f"{cap + 1} entries, more than {cap} (the model has {n_vocab} tokens)" in msg, msg
