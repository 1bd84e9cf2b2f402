"""One generation path, proven: the same greedy request through `ubatch cli`, `Llama` and the
server (real HTTP on loopback) gives the same text, the same stop reason and the same count."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from cli_inproc import run_cli
from test_server import Live

from ubatch import Llama
from ubatch.cli.server.app import ServerOptions, create_app
from ubatch.cli.server.run import start_engine
from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.serve.scheduler import Scheduler

FINISH = {"length": "length", "context": "length", "eog": "stop", "word": "stop"}  # OpenAI's names


def via_cli(model: Path, prompt: str, n_predict: int, n_ctx: int) -> dict[str, Any]:
    """The real `ubatch cli` in this process (tests/cli_inproc.py): a fresh process would pay
    seconds for importing torch."""
    flags = ["-m", str(model), "-p", prompt, "-n", str(n_predict), "-c", str(n_ctx), "--temp", "0", "-t", "1"]
    r = run_cli(["cli", *flags, "--no-display-prompt"])
    assert r.returncode == 0, r.stderr
    m = re.search(r"generation stopped: (\w+), (\d+) tokens sampled", r.stderr)
    assert m, r.stderr
    assert r.stdout.endswith("\n")
    return {"text": r.stdout[:-1], "reason": m.group(1), "n": int(m.group(2))}


def via_llama(model: Path, prompt: str, n_predict: int, n_ctx: int) -> dict[str, Any]:
    llm = Llama(str(model), n_ctx=n_ctx, n_threads=1)
    r = llm.create_completion(prompt, max_tokens=n_predict, temperature=0)
    c = r["choices"][0]
    return {"text": c["text"], "finish": c["finish_reason"], "n": r["usage"]["completion_tokens"]}


def via_server(model: Path, prompt: str, n_predict: int, n_ctx: int) -> dict[str, Any]:
    ctx = Context(Model.load(model), ContextParams(n_ctx=n_ctx, n_seq_max=1, n_outputs_max=1, n_threads=1))
    eng = start_engine(Scheduler(ctx, 1))
    live = Live(create_app(eng, ServerOptions()))
    try:
        r = httpx.post(
            live.url + "/completion", json={"prompt": prompt, "n_predict": n_predict, "temperature": 0}, timeout=300
        ).json()
        chunks = []
        with httpx.stream(
            "POST",
            live.url + "/completion",
            timeout=300,
            json={"prompt": prompt, "n_predict": n_predict, "temperature": 0, "stream": True, "cache_prompt": False},
        ) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    chunks.append(httpx.Response(200, content=line[6:]).json()["content"])
    finally:
        live.close()
        eng.stop()
    assert "".join(chunks) == r["content"]  # streamed or not, the same text
    return {"text": r["content"], "stop_type": r["stop_type"], "truncated": r["truncated"], "n": r["tokens_predicted"]}


def check_same(model: Path, prompt: str, n_predict: int, n_ctx: int) -> tuple[dict, dict, dict]:
    cli, llm, srv = (f(model, prompt, n_predict, n_ctx) for f in (via_cli, via_llama, via_server))
    assert cli["text"] == llm["text"] == srv["text"]
    assert cli["n"] == llm["n"] == srv["n"]
    assert FINISH[cli["reason"]] == llm["finish"]
    assert {"length": "limit", "context": "limit", "eog": "eos"}[cli["reason"]] == srv["stop_type"]
    assert srv["truncated"] == (cli["reason"] == "context")
    return cli, llm, srv


@pytest.mark.slow
def test_one_path_default_model_length(default_model_path: Path) -> None:
    cli, _, _ = check_same(default_model_path, "The capital of France is", 12, 512)
    assert cli["reason"] == "length" and cli["n"] == 12
    assert cli["text"].startswith(" the capital of the country of France.")  # llama.cpp's greedy text


def test_one_path_tiny_model_context_full(tiny_gemma: Path) -> None:
    prompt = "hello " * 230
    n_prompt = len(Llama(str(tiny_gemma), n_ctx=256).tokenize(prompt.encode()))
    assert 200 < n_prompt < 250
    cli, _, _ = check_same(tiny_gemma, prompt, -1, 256)
    assert cli["reason"] == "context" and cli["n"] == 256 - n_prompt
