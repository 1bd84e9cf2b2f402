"""`ubatch server` on a real loopback port: the official `openai` client, raw HTTP for llama.cpp's
native endpoints, continuous batching under concurrency, load, disconnects, bad input, and the
real CLI as a subprocess. Tiny random-weight models (gibberish, but greedy is deterministic);
the default Gemma 3 270M for the end-to-end chat checks.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from cli_inproc import run_cli
from starlette.testclient import TestClient

from ubatch.cli.server.app import ServerEngine, ServerOptions, ServerState, create_app
from ubatch.cli.server.run import start_engine
from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.serve.scheduler import Scheduler

GREEDY = {"temperature": 0, "ignore_eos": True}


class Live:
    """A uvicorn server on a free loopback port, in a thread of this process."""

    def __init__(self, app: Any) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def spawn(cmd: list[str]) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    """A server subprocess, the stderr lines it has written so far, and the thread reading them."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]  # stderr is a pipe here
    reader.start()
    return proc, lines, reader


def start_server_engine(path: Path, n_slots: int, n_ctx: int) -> ServerEngine:
    m = Model.load(path)
    ctx = Context(m, ContextParams(n_ctx=n_ctx, n_seq_max=n_slots, n_outputs_max=n_slots))
    return start_engine(Scheduler(ctx, n_slots))


@pytest.fixture(scope="module")
def tiny(tiny_gemma: Path) -> Iterator[tuple[str, ServerEngine]]:
    """-np 4 -c 1024 (256 per slot), --metrics."""
    eng = start_server_engine(tiny_gemma, 4, 1024)
    live = Live(create_app(eng, ServerOptions(metrics=True, alias="tiny")))
    yield live.url, eng
    live.close()
    eng.stop()


def post(url: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=data, timeout=60, **kw)


def sse_events(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    out = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def oai(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


# -- endpoints ------------------------------------------------------------------------------------


def test_health_models_props_slots(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["owned_by"] == "llamacpp" and models["data"][0]["meta"]["n_ctx"] == 256
    assert [m.id for m in oai(url).models.list()] == ["tiny"]
    props = httpx.get(url + "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 256
    assert props["chat_template"] == "gemma" and props["bos_token"] == "<bos>"
    slots = httpx.get(url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3] and all(s["n_ctx"] == 256 for s in slots)


def test_health_is_503_while_the_model_loads(tiny: tuple[str, ServerEngine]) -> None:
    state = ServerState()
    client = TestClient(create_app(state=state))
    for path in ("/health", "/v1/models", "/props"):
        r = client.get(path)
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    state.attach(tiny[1])
    assert client.get("/health").json() == {"status": "ok"}


def test_openai_text_completion_matches_native_completion(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    client = oai(url)
    r = client.completions.create(
        model="any", prompt="hello world", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.model == "any"
    assert (r.usage.completion_tokens, r.usage.prompt_tokens) == (8, 4)
    assert r.choices[0].finish_reason == "length"
    native = post(url, "/completion", {"prompt": "hello world", "n_predict": 8, **GREEDY}).json()
    assert native["content"] == r.choices[0].text and native["tokens_predicted"] == 8
    chunks = list(
        client.completions.create(
            model="any", prompt="hello world", max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_chat_uses_the_gemma_template(tiny: tuple[str, ServerEngine]) -> None:
    url, sch = tiny[0], tiny[1].scheduler
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = post(url, "/apply-template", {"messages": msgs}).json()["prompt"]
    assert prompt == "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    client = oai(url)
    r = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    n_prompt = len(sch.vocab.tokenize(prompt, True, True))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 6)
    native = post(url, "/completion", {"prompt": prompt, "n_predict": 6, **GREEDY}).json()
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == native["content"]
    stream = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=6,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == native["content"]
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 6


def test_native_completion_fields_stream_and_prompt_cache(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    body = {"prompt": "the world is", "n_predict": 5, **GREEDY}
    full = post(url, "/completion", body).json()
    n_prompt = full["tokens_evaluated"]
    assert {
        "index",
        "content",
        "tokens",
        "id_slot",
        "stop",
        "model",
        "tokens_predicted",
        "tokens_evaluated",
        "generation_settings",
        "prompt",
        "has_new_line",
        "truncated",
        "stop_type",
        "stopping_word",
        "tokens_cached",
        "timings",
    } <= set(full)
    assert (full["stop"], full["stop_type"], full["truncated"], full["prompt"]) == (
        True,
        "limit",
        False,
        "the world is",
    )
    assert full["tokens_cached"] == n_prompt + 5 - 1
    assert full["generation_settings"]["n_predict"] == 5
    events = sse_events(url, "/completion", {**body, "stream": True})
    assert "[DONE]" not in events  # the native stream ends without it
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == full["content"] and len(events) == 6
    # the second identical request reused all but one prompt token
    assert (events[-1]["timings"]["cache_n"], events[-1]["timings"]["prompt_n"]) == (n_prompt - 1, 1)
    t = events[-1]["timings"]
    assert t["predicted_n"] == 5 and t["prompt_per_second"] > 0
    with_tokens = post(url, "/completion", {**body, "return_tokens": True}).json()
    assert len(with_tokens["tokens"]) == 5 and with_tokens["content"] == full["content"]


def test_stop_strings(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    text = post(url, "/completion", {"prompt": "a b c", "n_predict": 12, **GREEDY}).json()["content"]
    word = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text[: text.find(word)]
    r = oai(url).completions.create(
        model="t", prompt="a b c", max_tokens=12, temperature=0, stop=[word], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    native = post(url, "/completion", {"prompt": "a b c", "n_predict": 12, "stop": word, **GREEDY}).json()
    assert (native["content"], native["stop_type"], native["stopping_word"]) == (cut, "word", word)
    events = sse_events(
        url, "/completion", {"prompt": "a b c", "n_predict": 12, "stop": [word], "stream": True, **GREEDY}
    )
    assert "".join(e["content"] for e in events) == cut


def test_logprobs(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    r = oai(url).chat.completions.create(
        model="t",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob <= 0 for c in content)  # greedy: the argmax
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == r.choices[0].message.content
    native = post(url, "/completion", {"prompt": "hi", "n_predict": 3, "n_probs": 2, **GREEDY}).json()
    probs = native["completion_probabilities"]
    assert len(probs) == 3 and all(
        len(p["top_logprobs"]) == 2 and {"id", "token", "bytes", "logprob"} <= set(p) for p in probs
    )
    cmpl = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 2, **GREEDY}).json()
    assert len(cmpl["choices"][0]["logprobs"]["content"]) == 3


def test_seed_and_several_choices(tiny: tuple[str, ServerEngine]) -> None:
    url, sch = tiny[0], tiny[1].scheduler
    body = {
        "prompt": "hello",
        "n_predict": 8,
        "temperature": 5.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "ignore_eos": True,
    }
    a, b, c = (post(url, "/completion", {**body, "seed": s}).json()["content"] for s in (42, 42, 7))
    assert a == b != c
    r = oai(url).completions.create(
        model="t", prompt="hello", max_tokens=3, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    assert [x.index for x in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text
    assert (r.usage.completion_tokens, r.usage.prompt_tokens) == (6, len(sch.vocab.tokenize("hello", True, True)))
    many = post(url, "/completion", {"prompt": ["hello", "world"], "n_predict": 2, **GREEDY}).json()
    assert [m["index"] for m in many] == [0, 1] and [m["prompt"] for m in many] == ["hello", "world"]


def test_logit_bias_bans_a_token(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    body = {"prompt": "hello", "n_predict": 1, "return_tokens": True, **GREEDY}
    first = post(url, "/completion", body).json()["tokens"][0]
    for bias in ([[first, False]], {str(first): -100}):
        r = post(url, "/completion", {**body, "logit_bias": bias})
        assert r.status_code == 200 and r.json()["tokens"][0] != first


def test_exceed_context_size(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    r = post(url, "/completion", {"prompt": [2] * 256, "n_predict": 4})
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "code": 400,
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 256,
            "n_ctx": 256,
            "message": "request (256 tokens) exceeds the available context size (256 tokens), try increasing it",
        }
    }
    with pytest.raises(openai.BadRequestError):
        oai(url).completions.create(model="t", prompt=[2] * 300, max_tokens=2)
    ok = post(url, "/completion", {"prompt": [2] * 255, "n_predict": 4}).json()
    assert (ok["tokens_predicted"], ok["truncated"], ok["stop_type"]) == (1, True, "limit")


def test_tokenize_detokenize(tiny: tuple[str, ServerEngine]) -> None:
    url, sch = tiny[0], tiny[1].scheduler
    toks = post(url, "/tokenize", {"content": "hello world"}).json()["tokens"]
    assert toks == sch.vocab.tokenize("hello world", False, True)
    assert post(url, "/tokenize", {"content": "hello", "add_special": True}).json()["tokens"][0] == sch.vocab.bos
    pieces = post(url, "/tokenize", {"content": "hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == toks and "".join(p["piece"] for p in pieces) == "hello world"
    assert post(url, "/detokenize", {"tokens": toks}).json() == {"content": "hello world"}


BAD = [  # path, body, status, error type, message fragment
    ("/completion", b"{bad json", 400, "invalid_request_error", "Invalid JSON"),
    ("/completion", b"[1, 2]", 400, "invalid_request_error", "prompt"),
    ("/completion", {"n_predict": 4}, 400, "invalid_request_error", "prompt"),
    ("/completion", {"prompt": 5}, 400, "invalid_request_error", "prompt"),
    (
        "/completion",
        {"prompt": "x", "n_predict": -5},
        400,
        "invalid_request_error",
        "Field 'n_predict': Value must be between -1 <= value <= 2147483647, but got -5",
    ),
    ("/completion", {"prompt": "x", "n_predict": 1e12}, 400, "invalid_request_error", "n_predict"),
    ("/completion", {"prompt": "x", "n_predict": "10"}, 400, "invalid_request_error", "n_predict"),
    ("/completion", {"prompt": "x", "temperature": "hot"}, 400, "invalid_request_error", "temperature"),
    ("/completion", {"prompt": "x", "stop": 5}, 400, "invalid_request_error", "stop"),
    ("/completion", {"prompt": "x", "stream": "yes"}, 400, "invalid_request_error", "stream"),
    ("/completion", {"prompt": "x", "seed": "abc"}, 400, "invalid_request_error", "seed"),
    ("/completion", {"prompt": "x", "n": 5}, 400, "invalid_request_error", "n"),
    ("/completion", {"prompt": "x", "logit_bias": 3}, 400, "invalid_request_error", "logit_bias"),
    ("/completion", {"prompt": [2, 99999]}, 400, "invalid_request_error", "invalid tokens"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "invalid_request_error", "Unsupported param: best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "invalid_request_error", "Unsupported param: suffix"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "invalid_request_error", "echo"),
    ("/v1/completions", {"model": "x"}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -2}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/chat/completions", {}, 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "invalid_request_error", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error", "content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "invalid_request_error",
        "image_url",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "invalid_request_error",
        "top_logprobs requires logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        400,
        "invalid_request_error",
        "tools",
    ),
    ("/tokenize", {"content": 5}, 400, "invalid_request_error", "content"),
    ("/detokenize", {"tokens": ["a"]}, 400, "invalid_request_error", "tokens"),
    ("/detokenize", {"tokens": [999999]}, 400, "invalid_request_error", "tokens"),
    ("/nope", {}, 404, "not_found_error", "File Not Found"),
]


@pytest.mark.parametrize("path,body,status,kind,fragment", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_with_llama_cpp_error_json(
    tiny: tuple[str, ServerEngine], path: str, body: Any, status: int, kind: str, fragment: str
) -> None:
    r = post(tiny[0], path, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert (err["code"], err["type"]) == (status, kind) and fragment in err["message"]


def test_server_survives_bad_input(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    assert httpx.get(url + "/completion").status_code == 404  # wrong method
    with pytest.raises(openai.BadRequestError):
        oai(url).completions.create(model="t", prompt="x", max_tokens=-3)
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert post(url, "/completion", {"prompt": "x", "n_predict": 2}).status_code == 200


def test_api_key_and_disabled_endpoints(tiny: tuple[str, ServerEngine]) -> None:
    live = Live(create_app(tiny[1], ServerOptions(api_keys=("k1", "k2"), slots=False)))
    try:
        url = live.url
        assert httpx.get(url + "/health").status_code == 200  # public
        assert httpx.get(url + "/v1/models").status_code == 401  # llama-server: only /health and the page are public
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}, {"X-Api-Key": "nope"}):
            r = post(url, "/completion", {"prompt": "x", "n_predict": 1}, headers=headers)
            assert r.status_code == 401
            assert r.json() == {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
        for headers in ({"Authorization": "Bearer k1"}, {"X-Api-Key": "k2"}):
            assert post(url, "/completion", {"prompt": "x", "n_predict": 1}, headers=headers).status_code == 200
        assert oai(url, "k2").completions.create(model="t", prompt="x", max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            oai(url, "wrong").completions.create(model="t", prompt="x", max_tokens=1)
        auth = {"Authorization": "Bearer k1"}
        m = httpx.get(url + "/metrics", headers=auth)
        assert m.status_code == 501 and m.json()["error"]["type"] == "not_supported_error"
        s = httpx.get(url + "/slots", headers=auth)
        assert s.status_code == 501 and "--slots" in s.json()["error"]["message"]
    finally:
        live.close()


# -- continuous batching, load, disconnects -------------------------------------------------------

PROMPTS = ["hello world", "the world", "a b c d e f", "hello there, world!"]


def _stream_text(url: str, prompt: str, n: int, barrier: threading.Barrier | None, out: list[str], i: int) -> None:
    client = oai(url)
    if barrier is not None:
        barrier.wait()
    chunks = client.completions.create(
        model="t",
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "cache_prompt": barrier is not None},
    )
    out[i] = "".join(c.choices[0].text for c in chunks)


def test_four_concurrent_streams_share_each_decode(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    name = 'ubatch:decodes_by_n_seqs_total{n_seqs="4"}'
    before, first_iter = metric(url, name), httpx.get(url + "/iterations").json()["iteration"]
    out, barrier = [""] * 4, threading.Barrier(4)
    threads = [threading.Thread(target=_stream_text, args=(url, p, 24, barrier, out, i)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert metric(url, name) > before
    records = [r for r in httpx.get(url + "/iterations").json()["records"] if r["index"] > first_iter]
    assert any(r["rows"] == {"0": 1, "1": 1, "2": 1, "3": 1} for r in records)  # one row per sequence
    alone = [""] * 4
    for i, p in enumerate(PROMPTS):  # the same requests one at a time, without the prompt cache
        _stream_text(url, p, 24, None, alone, i)
    assert out == alone and all(out)


def test_a_request_still_preparing_joins_the_first_batch(tiny_gemma: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests at an idle server: one is submitted while the other is still being prepared
    (held here in its tokenizing): the engine waits, and one decode starts both prompts. A
    request refused in its preparation leaves nothing arriving."""
    from ubatch.cli.server.routes import completion

    eng = start_server_engine(tiny_gemma, 2, 512)
    eng.loop.admit_wait_s = 600.0  # it never gives up on the held one here
    live = Live(create_app(eng))
    held, release = threading.Event(), threading.Event()
    prepare = completion.prepare

    def slow_prepare(st: Any, body: Any, kind: str) -> Any:
        if body.get("prompt") == "held":
            held.set()
            release.wait(60)
        return prepare(st, body, kind)

    monkeypatch.setattr(completion, "prepare", slow_prepare)
    try:
        url = live.url
        assert post(url, "/completion", {"prompt": "x", "n_predict": -3}).status_code == 400
        assert eng.loop.n_arriving == 0
        out: dict[str, Any] = {}

        def send(prompt: str) -> None:
            out[prompt] = post(url, "/completion", {"prompt": prompt, "n_predict": 3, **GREEDY}).json()

        first_iter = httpx.get(url + "/iterations").json()["iteration"]
        threads = [threading.Thread(target=send, args=(p,)) for p in ("held", "hello world")]
        threads[0].start()
        assert held.wait(30)
        threads[1].start()
        deadline = time.time() + 30
        while eng.loop.n_admit_waits == 0:
            assert time.time() < deadline, "the engine did not wait for the held request"
            time.sleep(0.005)
        release.set()
        for t in threads:
            t.join(60)
        assert all(o["tokens_predicted"] == 3 for o in out.values())
        records = [r for r in httpx.get(url + "/iterations").json()["records"] if r["index"] > first_iter]
        assert set(records[0]["rows"]) == {"0", "1"} and records[0]["n_gen"] == 0
        assert eng.loop.n_arriving == 0
    finally:
        release.set()
        live.close()
        eng.stop()


def test_sixteen_clients_against_four_slots(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    prompts = [f"hello {'world ' * (i % 5)}{chr(97 + i)}" for i in range(16)]
    ref = [
        post(url, "/completion", {"prompt": p, "n_predict": 10, "cache_prompt": False, **GREEDY}).json()
        for p in prompts
    ]
    first_iter = httpx.get(url + "/iterations").json()["iteration"]
    results: list[Any] = [None] * 16
    barrier = threading.Barrier(16)

    def client(i: int) -> None:
        body = {"prompt": prompts[i], "n_predict": 10, **GREEDY}
        barrier.wait()
        if i % 2:
            events = sse_events(url, "/completion", {**body, "stream": True})
            results[i] = {
                "content": "".join(e["content"] for e in events),
                "n": events[-1]["tokens_predicted"],
                "n_prompt": events[-1]["tokens_evaluated"],
                "finals": sum(e["stop"] for e in events),
            }
        else:
            r = post(url, "/completion", body).json()
            results[i] = {
                "content": r["content"],
                "n": r["tokens_predicted"],
                "n_prompt": r["tokens_evaluated"],
                "finals": 1,
            }

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, r in enumerate(results):
        assert r is not None, f"client {i} got no response"
        assert (r["content"], r["n"], r["n_prompt"], r["finals"]) == (
            ref[i]["content"],
            10,
            ref[i]["tokens_evaluated"],
            1,
        )
    info = httpx.get(url + "/iterations").json()
    records = [r for r in info["records"] if r["index"] > first_iter]
    assert max(r["n_queued"] for r in records) > 0  # requests waited for a slot
    assert max(len(r["rows"]) for r in records) == 4
    done = [r for r in info["releases"] if r["iteration"] > first_iter]
    assert len(done) == 16 and len({r["id_task"] for r in done}) == 16 and {r["reason"] for r in done} == {"limit"}
    assert httpx.get(url + "/health").status_code == 200
    assert not any(s["is_processing"] for s in httpx.get(url + "/slots").json())


def test_disconnect_mid_stream_frees_the_slot(tiny: tuple[str, ServerEngine]) -> None:
    url, _ = tiny
    cancelled = metric(url, "ubatch:requests_cancelled_total")
    with httpx.Client(timeout=30) as client:
        with client.stream(
            "POST", url + "/completion", json={"prompt": "hello", "n_predict": 200, "stream": True, **GREEDY}
        ) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            slot = first["id_slot"]
            task = httpx.get(url + "/slots").json()[slot]["id_task"]
    deadline = time.time() + 10
    while httpx.get(url + "/slots").json()[slot]["is_processing"]:
        assert time.time() < deadline, "slot still busy after the client disconnected"
        time.sleep(0.01)
    rel = next(r for r in httpx.get(url + "/iterations").json()["releases"] if r["id_task"] == task)
    assert rel["reason"] == "cancelled" and rel["iteration"] - rel["cancel_iteration"] == 1
    assert httpx.get(url + "/slots").json()[slot]["n_cache_tokens"] == 0  # its cells were freed
    assert metric(url, "ubatch:requests_cancelled_total") == cancelled + 1


# -- the real CLI -------------------------------------------------------------------------------


def test_cli_server_subprocess(tiny_gemma: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "ubatch.cli.main",
        "server",
        "-m",
        str(tiny_gemma),
        "-np",
        "2",
        "-c",
        "512",
        "--port",
        "0",
        "--api-key",
        "k1",
        "--metrics",
        "-a",
        "tiny",
        "-t",
        "1",
    ]
    proc, lines, reader = spawn(cmd)
    try:
        deadline = time.time() + 60
        port = None
        while port is None:
            assert time.time() < deadline and proc.poll() is None, "".join(lines)
            m = next((re.search(r"port: (\d+)", x) for x in lines if "HTTP server is listening" in x), None)
            port = int(m.group(1)) if m else None
            time.sleep(0.02)
        url, statuses = f"http://127.0.0.1:{port}", []
        while True:
            r = httpx.get(url + "/health")
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
            assert r.json()["error"] == {"code": 503, "message": "Loading model", "type": "unavailable_error"}
            assert time.time() < deadline
            time.sleep(0.05)
        auth = {"Authorization": "Bearer k1"}
        props = httpx.get(url + "/props", headers=auth).json()
        assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (2, 256)
        r = oai(url, "k1").chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == 3 and r.model == "tiny"
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        assert "llamacpp:n_decode_total" in httpx.get(url + "/metrics", headers=auth).text
        assert httpx.post(url + "/completion", json={"prompt": "x"}).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)
    reader.join(5)
    out = "".join(lines)
    assert rc == 0, out
    assert "n_slots = 2, n_ctx_slot = 256, kv_unified = 'false'" in out and "slot print_timing" in out


def test_cli_rejects_zero_slots() -> None:
    r = run_cli(["server", "-np", "0"])  # refused before anything binds or loads: the CLI in this process
    assert r.returncode == 1 and "invalid value for n_parallel" in r.stderr


# -- the default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_chat_end_to_end(default_model_path: Path) -> None:
    """Gemma 3 270M: the chat endpoint's greedy answer is the engine's greedy continuation of the
    gemma-templated prompt, and two concurrent streams answer as they do alone."""
    from ubatch.engine.completion.complete import complete
    from ubatch.engine.generation.generation import GenerationParams
    from ubatch.engine.sampling.chain import Sampler, SamplerParams

    eng = start_server_engine(default_model_path, 2, 1024)
    sch = eng.scheduler
    live = Live(create_app(eng))
    try:
        url, client = live.url, oai(live.url)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="gemma", messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]
        prompt = "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
        ctx = Context(sch.ctx.model, ContextParams(n_ctx=512, n_outputs_max=1))
        ids = sch.vocab.tokenize(prompt, True, True)
        ref = "".join(
            ev.text for ev in complete(ctx, ids, Sampler(SamplerParams(temp=0.0)), GenerationParams(n_predict=6))
        )
        assert r.choices[0].message.content == ref and r.usage.prompt_tokens == len(ids)
        out, barrier = ["", ""], threading.Barrier(2)
        prompts = ["The capital of France is", "Once upon a time"]
        threads = [
            threading.Thread(target=_stream_text, args=(url, p, 6, barrier, out, i)) for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        alone = ["", ""]
        for i, p in enumerate(prompts):
            _stream_text(url, p, 6, None, alone, i)
        assert out == alone and all(out)
        assert any(len(rec.rows) == 2 for rec in sch.records)
    finally:
        live.close()
        eng.stop()
