"""`ubatch server` started with llama-server command lines from llama.cpp's own documentation,
and spoken to as llama.cpp's web UI (native /completion with json_schema / grammar, streamed)
and the OpenAI client (response_format) speak to it: the servers start, constrained outputs
parse, the embedding routes answer on the server started with --embeddings, and a flag the
documentation uses that we refuse is one line.

The command lines, with `-hf REPO` / the model path replaced by a local file and the port by a
free one (tools/server/README.md, docs/function-calling.md, the README's docker line):
    llama-server -m models/7B/ggml-model.gguf -c 2048
    llama-server --jinja -fa -hf bartowski/gemma-2-2b-it-GGUF:Q8_0
    ... -m models/7B/ggml-model.gguf -c 512 --host 0.0.0.0 --port 8080 --n-gpu-layers 99
    llama-server -m model.gguf --embedding --pooling rank  (here: --pooling mean, no reranker)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_server import oai

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}


YES_NO = 'root ::= " yes" | " no"'  # the function-calling server's default grammar (--grammar)


class Server:
    """A real `ubatch server` process, ready when /health answers 200."""

    def __init__(self, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "ubatch.cli.main", "server", *args, "--port", "0", "-t", "1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()  # type: ignore[union-attr]
        deadline, port = time.time() + 120, None
        while port is None:
            assert time.time() < deadline and self.proc.poll() is None, "".join(self.lines)
            m = next((re.search(r"port: (\d+)", x) for x in self.lines if "HTTP server is listening" in x), None)
            port = int(m.group(1)) if m else None
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.time() < deadline and self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)

    def stop(self) -> None:
        """Ask it to stop (SIGTERM); `wait` for it after asking the others too."""
        self.proc.terminate()

    def wait(self) -> None:
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(default_model_path: Path, tiny_llama: Path) -> Iterator[dict[str, Server]]:
    lines = {
        "readme": ["-m", str(default_model_path), "-c", "2048"],
        "function_calling": ["--jinja", "-fa", "-m", str(default_model_path), "-np", "2", "--grammar", YES_NO],
        "docker": [
            "-m",
            str(tiny_llama),
            "-c",
            "512",
            "--host",
            "127.0.0.1",
            "--n-gpu-layers",
            "99",
            "--embeddings",
            "--pooling",
            "mean",
        ],
    }
    with ThreadPoolExecutor(len(lines)) as pool:
        started = dict(zip(lines, pool.map(Server, lines.values())))
    yield started
    for s in started.values():  # the graceful shutdowns run at the same time
        s.stop()
    for s in started.values():
        s.wait()


def test_documented_command_lines_start_with_notices(servers: dict[str, Server]) -> None:
    text = "".join(servers["function_calling"].lines)
    assert "notice: -fa: no effect here" in text
    assert "notice: -ngl 99: no effect here" in "".join(servers["docker"].lines)
    for s in servers.values():
        assert httpx.get(s.url + "/v1/models").status_code == 200


def test_web_ui_style_json_schema_and_grammar(servers: dict[str, Server]) -> None:
    url = servers["readme"].url
    body = {"prompt": "A person as JSON:", "n_predict": 64, "temperature": 0, "json_schema": PERSON}
    out = json.loads(httpx.post(url + "/completion", json=body, timeout=120).json()["content"])
    assert set(out) == {"name", "age"} and isinstance(out["age"], int) and 0 <= out["age"] <= 150
    body = {"prompt": "Is the sky blue? Answer:", "n_predict": 8, "temperature": 0.8, "seed": 3, "stream": True}
    body["grammar"] = 'root ::= " " ("yes" | "no") "."'
    with httpx.stream("POST", url + "/completion", json=body, timeout=120) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    assert "".join(c["content"] for c in chunks) in (" yes.", " no.")
    assert chunks[-1]["stop"] is True and chunks[-1]["stop_type"] == "eos"


def test_openai_client_response_format(servers: dict[str, Server]) -> None:
    c = oai(servers["function_calling"].url)
    msgs = [{"role": "user", "content": "Give me a person."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=64, temperature=0, response_format=fmt)  # type: ignore[arg-type]
    out = json.loads(r.choices[0].message.content or "")
    assert set(out) == {"name", "age"}
    # llama-server's json_object may carry a schema (without one, any object: unbounded for a test)
    ok = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_object", "schema": ok}
    r = c.chat.completions.create(model="x", messages=msgs, max_tokens=48, temperature=0, response_format=fmt)  # type: ignore[arg-type]
    assert set(json.loads(r.choices[0].message.content or "")) == {"ok"}


def test_bad_grammar_and_schema_are_400_and_the_server_stays_up(servers: dict[str, Server]) -> None:
    url = servers["readme"].url
    r = httpx.post(url + "/completion", json={"prompt": "x", "grammar": "root ::= foo"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/completion", json={"prompt": "x", "json_schema": {"$ref": "#/definitions/nope"}})
    assert r.status_code == 400
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_embeddings_on_the_embedding_server_only(servers: dict[str, Server]) -> None:
    r = httpx.post(servers["docker"].url + "/v1/embeddings", json={"input": ["hello", "world"]})
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    r = httpx.post(servers["readme"].url + "/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"]


def test_a_refused_documented_flag_is_one_line(default_model_path: Path) -> None:
    """docs/multimodal.md: llama-server -m gemma-3-4b-it-Q4_K_M.gguf --mmproj mmproj-....gguf"""
    cmd = [sys.executable, "-m", "ubatch.cli.main", "server", "-m", str(default_model_path), "--mmproj", "mmproj.gguf"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: -mm is not supported: ubatch is text-only: no multimodal projector, images, audio or video"
    ]


def test_the_server_grammar_is_every_request_default(servers: dict[str, Server]) -> None:
    url = servers["function_calling"].url
    r = httpx.post(url + "/completion", json={"prompt": "Is it?", "n_predict": 8, "temperature": 0}, timeout=120)
    assert r.json()["content"] in (" yes", " no") and r.json()["generation_settings"]["grammar"] == YES_NO
