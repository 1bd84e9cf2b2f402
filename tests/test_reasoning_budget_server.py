"""`ubatch server --reasoning-budget N` on real loopback servers with a tiny random model whose
template opens thinking itself (the prompt ends in `<think>\\n`, as Qwen 3.5's does): the reply's
reasoning stops after the budget's tokens, the end tag is forced, and what follows is content,
whole and streamed; a request's reasoning_budget_tokens / thinking_budget_tokens /
reasoning_budget_message, Anthropic's thinking.budget_tokens, a tool grammar after the forced
end, and the real command line with --reasoning-budget-message.

The random model is pushed to write "a" (a logit bias; or a server grammar of letters for the
Anthropic API, which carries no bias), so its thinking is visible text. As llama-server counts,
the prompt's newline after `<think>` is the budget's first token: a budget of 4 leaves 3
generated ones (llama-server's tokens are the same, checked by hand against its build).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from test_server import Live, start_server_engine
from tiny_vocab import piece_id

from ubatch.cli.server.app import ServerOptions, create_app
from ubatch.engine.grammar import compile_grammar

OPENS_THINKING = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
ASK = [{"role": "user", "content": "hi"}]
A = piece_id("a")
WRITE_A: dict[str, Any] = {"temperature": 0, "logit_bias": {str(A): 50}}
END = ["<", "/", "t", "h", "in", "k", ">"]  # `</think>` in the tiny vocabulary
LETTERS = 'root ::= [a-z]* "</think>" [a-z]+'


@pytest.fixture(scope="module")
def urls(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """One engine behind three apps with the thinking template: --reasoning-budget 4; no budget
    but a server grammar of letters; and a budget of 4 with that grammar."""
    template = tmp_path_factory.mktemp("tpl") / "opens.jinja"
    template.write_text(OPENS_THINKING)
    eng = start_server_engine(tiny_gemma, 2, 2048)
    letters = compile_grammar(LETTERS)
    apps = [
        Live(create_app(eng, ServerOptions(alias="tiny", chat_template=str(template), reasoning_budget=4))),
        Live(create_app(eng, ServerOptions(alias="tiny", chat_template=str(template), grammar=letters))),
        Live(
            create_app(
                eng, ServerOptions(alias="tiny", chat_template=str(template), grammar=letters, reasoning_budget=4)
            )
        ),
    ]
    yield apps[0].url, apps[1].url, apps[2].url
    for a in apps:
        a.close()
    eng.stop()


def chat(url: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(
        url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 16, **WRITE_A, **body}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def tokens(choice: dict[str, Any]) -> list[str]:
    return [t["token"] for t in choice["logprobs"]["content"]]


def streamed(url: str, **body: Any) -> tuple[str, str]:
    """The reasoning and the content a stream's deltas add up to."""
    reasoning, content = "", ""
    payload = {"messages": ASK, "max_tokens": 16, "stream": True, **WRITE_A, **body}
    with httpx.stream("POST", url + "/v1/chat/completions", json=payload, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:]).get("choices", []):
                    reasoning += ch["delta"].get("reasoning_content") or ""
                    content += ch["delta"].get("content") or ""
    return reasoning, content


def test_the_budget_forces_the_end_tag(urls: tuple[str, str, str]) -> None:
    url = urls[0]
    prompt = httpx.post(url + "/apply-template", json={"messages": ASK}, timeout=60).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    c = chat(url, logprobs=True, top_logprobs=1)
    # 3 thinking tokens (the prompt's newline was the 4th), then the end tag, forced, then free text
    assert tokens(c)[:10] == ["a", "a", "a", *END]
    assert c["message"]["reasoning_content"] == "aaa" and c["message"]["content"] == "a" * 6
    assert streamed(url) == ("aaa", "a" * 6)
    # a request's own budget, under either name; -1 is the server's
    for body, thought in (
        ({"reasoning_budget_tokens": 2}, "a"),
        ({"thinking_budget_tokens": 3}, "aa"),
        ({"reasoning_budget_tokens": 6, "thinking_budget_tokens": 2}, "aaaaa"),
        ({"reasoning_budget_tokens": -1}, "aaa"),
    ):
        assert chat(url, **body)["message"]["reasoning_content"] == thought, body
        assert streamed(url, **body)[0] == thought, body
    # a message is forced before the end tag
    c = chat(url, reasoning_budget_tokens=3, reasoning_budget_message=" ok", max_tokens=20)
    assert c["message"]["reasoning_content"] == "aa ok" and c["message"]["content"].startswith("a")
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "reasoning_budget_tokens": -2}, timeout=60)
    assert r.status_code == 400 and "reasoning_budget_tokens" in r.json()["error"]["message"]


def test_zero_ends_thinking_at_once(urls: tuple[str, str, str]) -> None:
    """Budget 0 ends the block the template opened: only the prompt's newline is in it."""
    c = chat(urls[0], reasoning_budget_tokens=0, logprobs=True, top_logprobs=1)
    assert tokens(c)[:7] == END and "reasoning_content" not in c["message"]
    assert c["message"]["content"] == "a" * 9


def test_without_a_budget_thinking_runs_on(urls: tuple[str, str, str]) -> None:
    """The server grammar writes letters then `</think>`; nothing forces the end, so a short
    reply is all thinking. With --reasoning-budget 4 the same request is cut after 3 letters."""
    free = chat(urls[1], max_tokens=12, logit_bias={})
    assert free["finish_reason"] == "length" and len(free["message"]["reasoning_content"]) == 12
    cut = chat(urls[2], max_tokens=12, logit_bias={})
    assert len(cut["message"]["reasoning_content"]) == 3 and cut["message"]["content"]


def test_anthropic_thinking_budget(urls: tuple[str, str, str]) -> None:
    """thinking.budget_tokens becomes llama-server's thinking_budget_tokens."""
    body = {
        "model": "tiny",
        "max_tokens": 16,
        "messages": ASK,
        "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 3},
    }
    r = httpx.post(urls[1] + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert len(blocks[0]["thinking"]) == 2 and re.fullmatch("[a-z]+", blocks[1]["text"])


def test_a_tool_grammar_follows_the_forced_end(urls: tuple[str, str, str]) -> None:
    """The generic tool format (the template knows no tool markers) with tool_choice required:
    its grammar expects the thinking block the prompt opened, takes the forced `</think>`, and
    the call after it is well-formed."""
    schema = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 5}}, "required": ["tz"]}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": schema}}]
    c = chat(urls[0], tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=600)
    assert c["finish_reason"] == "tool_calls" and c["message"]["reasoning_content"] == "aaa"
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_command_line(tiny_gemma: Path, tmp_path: Path) -> None:
    """The real CLI: --reasoning-budget and --reasoning-budget-message reach every chat."""
    template = tmp_path / "opens.jinja"
    template.write_text(OPENS_THINKING)
    cmd = [sys.executable, "-m", "ubatch.cli.main", "server", "-m", str(tiny_gemma), "--port", "0", "-t", "1"]
    cmd += ["-c", "512", "-np", "1", "--chat-template-file", str(template)]
    cmd += ["--reasoning-budget", "3", "--reasoning-budget-message", " ok"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        deadline, url = time.time() + 120, ""
        while not url:
            assert time.time() < deadline and proc.poll() is None, "".join(lines)
            m = next((re.search(r"port: (\d+)", x) for x in lines if "HTTP server is listening" in x), None)
            url = f"http://127.0.0.1:{m.group(1)}" if m else ""
            time.sleep(0.05)
        while httpx.get(url + "/health").status_code != 200:
            assert time.time() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        assert chat(url, max_tokens=20)["message"]["reasoning_content"] == "aa ok"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run(
        [*cmd[:4], "-m", str(tiny_gemma), "--reasoning-budget", "-2"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and "--reasoning-budget" in bad.stderr and "Traceback" not in bad.stderr
