"""A byte-level BPE model end to end: a tiny random Qwen 2 whose tokenizer is Qwen 2's own
(tokenizer.json rebuilt from llama.cpp's test vocabulary, Qwen 2.5's chat template), converted by
llama.cpp's convert_hf_to_gguf.py, answering through `ubatch cli`, a real `ubatch server` (chat
template, streaming, a tool call) and the `Llama` API. The random model's bytes are arbitrary, so
the checks are what a tokenizer decides: ids, pieces held until their UTF-8 is whole, streams
that add up to the whole answer, calls valid for the tool's schema."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest
import tiny_bpe
import tiny_families
from test_cli import ubatch_inproc
from test_server_cmdline import Server
from test_server_tools import ASK, GREEDY, QWEN25, SCHEMAS, TOOLS, client

TEXT = "Hello, world! 你好 😁 3333 tokens\n\tindented   code();"


@pytest.fixture(scope="module")
def qwen2_bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tiny_families.llama_cpp_src()
    if src is None:
        pytest.skip("llama.cpp's converter and test vocabularies are not available (../shared/tools/llama-cpp.sh)")
    root = tmp_path_factory.mktemp("qwen2-bpe")
    d = tiny_bpe.write_qwen2_checkpoint(root / "hf", src, QWEN25)
    return tiny_families.convert_llama_cpp(d, root / "qwen2-bpe.gguf", own_vocab=True)


def test_cli_and_llama_api(qwen2_bpe: Path) -> None:
    """The CLI completes a prompt of mixed scripts greedily and prints it back as given; the API's
    tokens are `ubatch tokenize`'s, decode to the text, and its completion is the CLI's."""
    from ubatch import Llama

    runs = ubatch_inproc(
        {
            "tokenize": ["tokenize", "-m", qwen2_bpe, "-p", TEXT, "--ids", "--no-bos"],
            "cli": ["cli", "-m", qwen2_bpe, "-p", TEXT, "-n", "8", "--temp", "0", "-c", "256", "-t", "2"],
        }
    )
    assert all(r.returncode == 0 for r in runs.values()), [r.stderr[-1500:] for r in runs.values()]
    assert runs["cli"].stdout.startswith(TEXT)
    llm = Llama(model_path=str(qwen2_bpe), n_ctx=256, verbose=False)
    ids = llm.tokenize(TEXT.encode(), add_bos=False)
    assert ids == json.loads(runs["tokenize"].stdout) and llm.detokenize(ids) == TEXT.encode()
    assert len(ids) < len(TEXT.encode()) / 2  # merged by Qwen 2's ranks, not byte by byte
    out = llm.create_completion(TEXT, max_tokens=8, temperature=0)
    assert TEXT + out["choices"][0]["text"] == runs["cli"].stdout.rstrip("\n")


def test_server_chat_streaming_and_a_tool_call(qwen2_bpe: Path) -> None:
    """Chat through the file's own template (Qwen 2.5's, from the converted tokenizer_config):
    a streamed answer's pieces add up to the whole one and none carries half a character; a
    required tool call comes back valid for its schema, streamed and whole alike."""
    server = Server(["-m", str(qwen2_bpe), "-c", "1024"])
    try:
        c = client(server.url)
        messages = [{"role": "user", "content": TEXT}]
        short = GREEDY | {"max_tokens": 16}
        whole = c.chat.completions.create(model="tiny", messages=messages, **short)  # type: ignore[arg-type]
        text = whole.choices[0].message.content or ""
        stream = c.chat.completions.create(model="tiny", messages=messages, stream=True, **short)  # type: ignore[arg-type]
        pieces = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
        assert "".join(pieces) == text
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])  # a piece never ends mid-character
        props = httpx.get(server.url + "/props").json()
        assert "<tool_call>" in props["chat_template"]
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
        call = (r.choices[0].message.tool_calls or [])[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    finally:
        server.stop()
        server.wait()
