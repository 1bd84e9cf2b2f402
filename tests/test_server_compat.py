"""`ubatch server` against what llama-server answers at its HTTP edge, on real loopback servers:
CORS (localhost reflected, other origins refused, the preflight before the API key), the
Server header, --api-prefix, several --host addresses (IPv4, IPv6, a UNIX socket) through the
real CLI, and the discovery and monitoring bodies (/v1/models, /props, /slots, /metrics) with
the keys, names and formats of this llama-server version.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import typer
from test_server import GREEDY, Live, spawn, start_server_engine

from ubatch.cli.server.app import ServerEngine, ServerOptions, create_app
from ubatch.cli.server.bind import bind_all

LOCAL = ["http://localhost", "http://localhost:5173", "https://127.0.0.1:3000", "http://[::1]", "http://[::1]:8080"]
FOREIGN = ["http://evil.com", "http://localhost.evil.com", "http://notlocalhost", "http://127.0.0.2", "null"]


@pytest.fixture(scope="module")
def eng(tiny_gemma: Path) -> Iterator[ServerEngine]:
    s = start_server_engine(tiny_gemma, 2, 512)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def url(eng: ServerEngine) -> Iterator[str]:
    """Our defaults for CORS (localhost only), --metrics, two aliases and two tags."""
    opts = ServerOptions(metrics=True, aliases=("zeta", "alpha"), tags=("t2", "t1"))
    live = Live(create_app(eng, opts))
    yield live.url
    live.close()


def serve(eng: ServerEngine, **kw: object) -> Live:
    return Live(create_app(eng, ServerOptions(**kw)))  # type: ignore[arg-type]


def preflight(url: str, origin: str) -> httpx.Response:
    h = {"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
    return httpx.options(url + "/v1/chat/completions", headers=h)


def test_cors_reflects_localhost_origins_only(url: str) -> None:
    for origin in LOCAL:
        r = httpx.get(url + "/health", headers={"Origin": origin})
        assert r.headers.get("access-control-allow-origin") == origin, origin
        assert preflight(url, origin).headers["access-control-allow-origin"] == origin
    for origin in FOREIGN:
        assert "access-control-allow-origin" not in httpx.get(url + "/health", headers={"Origin": origin}).headers
        assert "access-control-allow-origin" not in preflight(url, origin).headers
    r = httpx.get(url + "/health")
    assert "access-control-allow-origin" not in r.headers and "llama.cpp" in r.headers.get_list("server")


def test_preflight_headers_and_api_key(eng: ServerEngine) -> None:
    live = serve(eng, api_keys=("k1",), cors_origins="*")
    try:
        r = preflight(live.url, "http://web.example")  # no key: a browser's preflight carries none
        assert r.status_code == 200 and r.text == ""
        assert r.headers["access-control-allow-origin"] == "*"
        assert r.headers["access-control-allow-credentials"] == "false"
        assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        assert r.headers["access-control-allow-headers"] == "*"
        denied = httpx.post(live.url + "/completion", json={"prompt": "x"}, headers={"Origin": "http://a.b"})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
    finally:
        live.close()
    live = serve(eng, cors_origins="*", cors_credentials=True)  # echoes the origin, with credentials
    try:
        r = preflight(live.url, "http://web.example")
        assert r.headers["access-control-allow-origin"] == "http://web.example"
        assert r.headers["access-control-allow-credentials"] == "true"
    finally:
        live.close()
    listed = "http://a.example,http://b.example"
    live = serve(eng, cors_origins=listed, cors_methods="GET, POST")  # a list is sent as given
    try:
        r = preflight(live.url, "http://c.example")
        assert r.headers["access-control-allow-origin"] == listed
        assert r.headers["access-control-allow-methods"] == "GET, POST"
    finally:
        live.close()


def test_api_prefix(eng: ServerEngine) -> None:
    live = serve(eng, api_prefix="/llm")
    try:
        assert httpx.get(live.url + "/llm/health").json() == {"status": "ok"}
        r = httpx.post(live.url + "/llm/completion", json={"prompt": "hello", "n_predict": 2, **GREEDY})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
        assert httpx.get(live.url + "/llm/v1/models").status_code == 200
        for path in ("/health", "/v1/models", "/llmx/health"):
            r = httpx.get(live.url + path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    finally:
        live.close()


def test_models_list_aliases_and_tags(url: str, eng: ServerEngine) -> None:
    body = httpx.get(url + "/v1/models").json()
    other = httpx.get(url + "/models").json()
    assert other["models"] == body["models"] and other["data"][0]["id"] == body["data"][0]["id"]
    (m,) = body["data"]
    assert (m["id"], m["aliases"], m["tags"]) == ("alpha", ["alpha", "zeta"], ["t1", "t2"])  # sets, sorted
    assert m["object"] == "model" and m["owned_by"] == "llamacpp"
    assert m["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}
    assert set(m["meta"]) == {"vocab_type", "n_vocab", "n_ctx", "n_ctx_train", "n_embd", "n_params", "size", "ftype"}
    sch = eng.scheduler
    assert m["meta"]["n_ctx"] == sch.n_ctx_slot and m["meta"]["n_vocab"] == sch.vocab.n_tokens
    assert body["models"][0]["name"] == "alpha" and body["models"][0]["capabilities"] == ["completion"]
    r = httpx.post(
        url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    assert r.json()["model"] == "alpha"
    live = serve(eng)  # no alias: the model path is the id and the one alias
    try:
        (m,) = httpx.get(live.url + "/v1/models").json()["data"]
        assert m["id"] == str(eng.scheduler.ctx.model.path) and m["aliases"] == [m["id"]] and m["tags"] == []
    finally:
        live.close()


PROPS_KEYS = {
    "default_generation_settings",
    "total_slots",
    "model_alias",
    "model_ftype",
    "model_path",
    "modalities",
    "media_marker",
    "endpoint_slots",
    "endpoint_props",
    "endpoint_metrics",
    "ui",
    "ui_settings",
    "chat_template",
    "chat_template_caps",
    "bos_token",
    "eos_token",
    "build_info",
    "is_sleeping",
    "cors_proxy_enabled",
}
SLOT_KEYS = {"id", "n_ctx", "speculative", "is_processing", "n_cache_tokens"}
TASK_KEYS = {"id_task", "n_prompt_tokens", "n_prompt_tokens_processed", "n_prompt_tokens_cache", "params", "next_token"}
# ubatch's own: where the cached prompt tokens came from (the slot's cells, another sequence's, host memory)
TASK_KEYS |= {"n_prompt_tokens_cache_own", "n_prompt_tokens_cache_shared", "n_prompt_tokens_cache_ram"}
TASK_KEYS |= {"prompt_cache_source_slot"}


def test_props_and_slots_keys(url: str) -> None:
    props = httpx.get(url + "/props").json()
    assert set(props) == PROPS_KEYS and set(props["default_generation_settings"]) == {"params", "n_ctx"}
    assert props["model_alias"] == "alpha" and props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert props["chat_template_caps"]["supports_string_content"] and not props["chat_template_caps"]["supports_tools"]
    r = httpx.post(url + "/props", json={})
    assert r.status_code == 501 and "--props" in r.json()["error"]["message"]
    httpx.post(url + "/completion", json={"prompt": "hello", "n_predict": 2, "id_slot": 1, **GREEDY})
    s0, s1 = httpx.get(url + "/slots").json()
    assert set(s0) in (SLOT_KEYS, SLOT_KEYS | TASK_KEYS) and set(s1) == SLOT_KEYS | TASK_KEYS  # no prompt text
    assert s1["next_token"][0]["n_decoded"] == 2


COUNTERS = [
    "prompt_tokens_total",
    "prompt_tokens_cached_total",
    "prompt_seconds_total",
    "tokens_predicted_total",
    "tokens_predicted_seconds_total",
    "n_decode_total",
    "n_tokens_max",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_drafts_total",
]
GAUGES = [
    "prompt_tokens_seconds",
    "predicted_tokens_seconds",
    "requests_processing",
    "requests_deferred",
    "n_busy_slots_per_decode",
]


def test_metrics_names_types_and_content_type(url: str) -> None:
    body = {"prompt": "the world is a hello world", "n_predict": 2, "id_slot": 0, **GREEDY}
    httpx.post(url + "/completion", json=body)
    r = httpx.get(url + "/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4" and int(r.headers["process-start-time-unix"]) > 0
    lines = [x for x in r.text.splitlines() if "llamacpp:" in x]
    expect = [(n, "counter") for n in COUNTERS] + [(n, "gauge") for n in GAUGES]
    assert len(lines) == 3 * len(expect)
    values = {}
    for i, (name, kind) in enumerate(expect):
        help_, type_, value = lines[3 * i : 3 * i + 3]
        assert re.fullmatch(rf"# HELP llamacpp:{name} \S.*", help_), help_
        assert type_ == f"# TYPE llamacpp:{name} {kind}"
        m = re.fullmatch(rf"llamacpp:{name} (\S+)", value)
        assert m, value
        values[name] = float(m.group(1))
    httpx.post(url + "/completion", json=body)  # the same prompt on the same slot: its prefix is cached
    after = httpx.get(url + "/metrics").text
    cached = float(re.search(r"^llamacpp:prompt_tokens_cached_total (\S+)$", after, re.M).group(1))  # type: ignore[union-attr]
    assert cached > values["prompt_tokens_cached_total"]


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_listens_on_every_host(tiny_gemma: Path, tmp_path: Path) -> None:
    """--host 127.0.0.1,::1,PATH.sock: one server, every address answers, each one logged."""
    sock_path = tmp_path / "ubatch.sock"
    hosts = ["127.0.0.1", *(["::1"] if _has_ipv6() else []), str(sock_path)]
    port = _free_port()
    cmd = [sys.executable, "-m", "ubatch.cli.main", "server", "-m", str(tiny_gemma), "-c", "256", "-np", "1"]
    cmd += ["--host", ",".join(hosts), "--port", str(port), "-t", "1", "--no-warmup"]
    proc, lines, _ = spawn(cmd)
    try:
        deadline = time.time() + 60
        while not any("listening on unix://" in x for x in lines):
            assert time.time() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        urls = [f"http://127.0.0.1:{port}"] + ([f"http://[::1]:{port}"] if "::1" in hosts else [])
        for u in urls:
            r = httpx.get(u + "/health")
            assert r.json() == {"status": "ok"} and r.headers.get_list("server") == ["llama.cpp"]
            assert any(f"listening on {u}" in x for x in lines), "".join(lines)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock_path))) as c:
            assert c.get("http://ubatch/health").json() == {"status": "ok"}
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    assert not sock_path.exists()  # removed on exit


def test_port_zero_needs_one_tcp_host_and_a_busy_port_fails(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit):
        bind_all(["127.0.0.1", "::1"], 0)
    assert "--port 0 is not supported with multiple TCP addresses" in capsys.readouterr().err
    socks, addrs = bind_all(["127.0.0.1"], 0)  # one TCP address: any free port
    try:
        port = socks[0].getsockname()[1]
        assert addrs == [f"http://127.0.0.1:{port}"]
        with pytest.raises(typer.Exit):
            bind_all(["127.0.0.1"], port)
        assert f"couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}" in capsys.readouterr().err
    finally:
        socks[0].close()


def test_ignore_eos_shows_in_logit_bias_as_llama_server(eng: ServerEngine, url: str) -> None:
    """llama-server's ignore_eos adds every end-of-generation token to logit_bias with -inf (JSON
    null in the echo): the settings a client reads back say why generation went on."""
    body = {"prompt": "hello", "n_predict": 2, "temperature": 0}
    plain = httpx.post(url + "/completion", json=body).json()["generation_settings"]
    assert plain["ignore_eos"] is False and plain["logit_bias"] == []
    on = httpx.post(url + "/completion", json={**body, "ignore_eos": True}).json()["generation_settings"]
    eog = sorted(eng.scheduler.vocab.eog)
    assert on["ignore_eos"] is True and eog
    assert on["logit_bias"] == [{"bias": None, "token": t} for t in eog]
