"""The vocabulary stays compact: one UTF-8 blob and numpy tables, no Python object per token, and
sentencepiece (~40 MiB for Gemma's 262,144 pieces) only once a text long enough to need it comes.
The parse and the index are checked against plain lists and dicts on real GGUF bytes."""

from __future__ import annotations

import gc
import random
import struct
import subprocess
import sys
import types
from pathlib import Path

import gguf
import pytest
from tiny_vocab import add_spm_vocab, tiny_spm_vocab

from ubatch.engine.gguf.file import open_gguf
from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab import vocab as vocab_module
from ubatch.engine.vocab.token_index import TokenIndex
from ubatch.engine.vocab.vocab import Vocab

REF_TEXTS = [line for line in (Path(__file__).parent / "refdata" / "tokenize.jsonl").read_text().splitlines()]


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _reachable_strs(root: object) -> int:
    """str objects reachable from root through containers and instances (not modules/classes)."""
    seen, todo, n = set(), [root], 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, _OPAQUE):
            continue
        seen.add(id(o))
        n += isinstance(o, str)
        todo.extend(gc.get_referents(o))
        if hasattr(o, "__slots__"):
            todo.extend(getattr(o, s) for s in o.__slots__ if hasattr(o, s))
    return n


@pytest.fixture(scope="module")
def gemma_meta(default_model_path: Path) -> dict:
    return open_gguf(default_model_path).metadata


@pytest.mark.slow
def test_no_python_str_per_token(gemma_meta: dict) -> None:
    tokens = gemma_meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == 262144
    v = Vocab.from_metadata(gemma_meta, "gemma")
    v.tokenize("The capital of France is")
    # the special-token groups hold ~13k texts; a str per token would be 262,144 more
    assert _reachable_strs(v) < 30_000
    assert _reachable_strs(gemma_meta) < 1_000


@pytest.mark.slow
def test_sentencepiece_only_for_long_texts(gemma_meta: dict) -> None:
    v = Vocab.from_metadata(gemma_meta, "gemma")
    assert v.tokenize("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert v._processor is vocab_module._UNBUILT  # not built for a short prompt
    long = "The capital of France is Paris. " * 40
    ids = v.tokenize(long)
    assert hasattr(v._processor, "encode")  # built by the first long text
    py = Vocab.from_metadata(gemma_meta, "gemma", use_sentencepiece=False)
    assert py.tokenize(long) == ids


@pytest.mark.slow
def test_sentencepiece_and_python_loop_agree_on_every_reference_text(gemma_meta: dict) -> None:
    import json

    sp = Vocab.from_metadata(gemma_meta, "gemma", sp_min_chars=0)  # sentencepiece for every text
    py = Vocab.from_metadata(gemma_meta, "gemma", use_sentencepiece=False)
    for text in [json.loads(r)["text"] for r in REF_TEXTS]:
        for flags in [(True, True), (False, False)]:
            assert sp.tokenize(text, *flags) == py.tokenize(text, *flags), text
    assert hasattr(sp._processor, "encode")


@pytest.mark.slow
def test_loading_the_vocabulary_stays_small(default_model_path: Path) -> None:
    """Peak RSS added by open_gguf + Vocab + a short tokenize, in a fresh process: ~34 MiB now,
    ~107 MiB with a str per token, a dict and an eager sentencepiece."""
    code = (
        "import sys, numpy\n"
        "from ubatch.engine.gguf.file import open_gguf\nfrom ubatch.engine.vocab.vocab import Vocab\n"
        "hwm = lambda: [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')][0] / 1024\n"
        "a = hwm()\nv = Vocab.from_metadata(open_gguf(sys.argv[1]).metadata, 'm')\n"
        "v.tokenize('The capital of France is')\nprint(hwm() - a)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(default_model_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split()[-1]) < 50


def _write(path: Path, tokens: list[str], scores: list[float], types: list[int]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    add_spm_vocab(w, tokens, scores, types)
    w.add_unk_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_big_string_array_reads_back_as_the_list_written(tmp_path: Path) -> None:
    tokens, scores, types = tiny_spm_vocab()
    extra = [f"[filler {i}] ☃{'é' * (i % 5)}" for i in range(5000)]  # past LARGE_ARRAY: a StringArray
    big = _write(tmp_path / "big.gguf", tokens + extra, scores + [-1e4] * 5000, types + [5] * 5000)
    arr = open_gguf(big).metadata["tokenizer.ggml.tokens"]
    assert isinstance(arr, StringArray) and list(arr) == tokens + extra
    assert arr[-1] == extra[-1] and arr.piece(7) == tokens[7].encode()
    meta = dict(open_gguf(big).metadata)
    v = Vocab.from_metadata(meta, sp_min_chars=0)
    small = Vocab.from_metadata({**meta, "tokenizer.ggml.tokens": tokens + extra}, use_sentencepiece=False)
    rng = random.Random(2)
    for _ in range(100):
        text = "".join(rng.choice("the world hello ☃\n<>_é") for _ in range(rng.randrange(60)))
        assert v.tokenize(text, True, True) == small.tokenize(text, True, True)
    assert [v.token_to_piece(i, True) for i in range(len(arr))] == [
        small.token_to_piece(i, True) for i in range(len(arr))
    ]


def test_parse_replaces_invalid_utf8_and_refuses_truncation() -> None:
    items = [b"ok", b"", b"\xe6\x97\xa5", b"bad\xff", b"\x97\xa5", "▁x".encode()] * 1000
    raw = b"".join(struct.pack("<Q", len(b)) + b for b in items)
    arr, end = StringArray.parse(memoryview(raw), 0, len(items))
    assert end == len(raw) and list(arr) == [b.decode("utf-8", errors="replace") for b in items]
    with pytest.raises(EOFError):
        StringArray.parse(memoryview(raw[:-1]), 0, len(items))
    with pytest.raises(EOFError):
        StringArray.parse(memoryview(raw), 0, len(items) + 1)


def test_token_index_is_a_dict_of_the_texts() -> None:
    rng = random.Random(3)
    texts = sorted({"".join(rng.choice("ab▁日🙂") for _ in range(rng.randrange(1, 6))) for _ in range(3000)})
    ix = TokenIndex(StringArray.from_strings(texts))
    assert all(ix.get(t) == i for i, t in enumerate(texts)) and ix.duplicate is None
    probes = ["".join(rng.choice("ab▁日🙂c") for _ in range(rng.randrange(0, 7))) for _ in range(3000)]
    d = {t: i for i, t in enumerate(texts)}
    assert [ix.get(p) for p in probes] == [d.get(p) for p in probes]
    assert TokenIndex(StringArray.from_strings(["x", "y", "z", "y", "x"])).duplicate == 0
