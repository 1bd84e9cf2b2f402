"""Every tokenizer kind against llama.cpp: its own test vocabularies (models/ggml-vocab-*.gguf with
.inp/.out, read from the sdist, never copied here), random texts through libllama when a build of
../shared/tools/llama-cpp.sh is on this machine, and the pieces that vocabularies rarely reach."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from ubatch.engine.gguf.file import open_gguf
from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab.bpe import byte_decode, byte_encode
from ubatch.engine.vocab.partition import group_specials, partition
from ubatch.engine.vocab.pre_tokenizer import PRE_TOKENIZERS, UNSUPPORTED_PRE, Splitter
from ubatch.engine.vocab.token_stream import TokenStreamer
from ubatch.engine.vocab.unicode import llama_text
from ubatch.engine.vocab.vocab import Vocab, clean_spaces

REPO = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_tokenizers", REPO / "scripts" / "check_tokenizers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


check_tokenizers = _script()  # scripts/check_tokenizers.py: libllama's side of the comparison

SEP = "\n__ggml_vocab_test__\n"  # llama.cpp's tests/test-tokenizer-0.cpp
KINDS = {  # name -> (tokenizer.ggml.model, tokenizer.ggml.pre, cases)
    "bert-bge": ("bert", "bert-bge", 47),
    "command-r": ("gpt2", "command-r", 47),
    "deepseek-coder": ("gpt2", "deepseek-coder", 47),
    "deepseek-llm": ("gpt2", "deepseek-llm", 47),
    "falcon": ("gpt2", "falcon", 47),
    "gemma-4": ("gemma4", "gemma4", 46),
    "gpt-2": ("gpt2", "gpt-2", 47),
    "llama-bpe": ("gpt2", "llama-bpe", 47),
    "llama-spm": ("llama", "default", 47),
    "mpt": ("gpt2", "mpt", 47),
    "phi-3": ("llama", "default", 47),
    "qwen2": ("gpt2", "qwen2", 47),
    "qwen35": ("gpt2", "qwen35", 51),
    "refact": ("gpt2", "refact", 47),
    "starcoder": ("gpt2", "starcoder", 47),
}


@cache
def llama_src() -> Path:
    tool = check_tokenizers.TOOL
    if not tool.exists():
        pytest.skip(f"{tool} is not beside the repository")
    out = subprocess.run([str(tool)], env={**os.environ, "LLAMA_CPP_SRC": "1"}, capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"llama.cpp's sdist is unavailable: {out.stderr.strip()[-200:]}")
    return Path(out.stdout.strip())


@cache
def vocab(name: str) -> Vocab:
    return Vocab.from_metadata(open_gguf(llama_src() / "models" / f"ggml-vocab-{name}.gguf").metadata, name)


def test_the_sdist_has_exactly_these_test_vocabularies() -> None:
    found = {p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in (llama_src() / "models").glob("*.gguf.inp")}
    assert found == set(KINDS)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_llama_cpp_test_vocabulary(name: str) -> None:
    model, pre, n = KINDS[name]
    base = llama_src() / "models" / f"ggml-vocab-{name}.gguf"
    inputs = base.with_name(base.name + ".inp").read_bytes().decode().split(SEP)
    outputs = base.with_name(base.name + ".out").read_text().split("\n")[: len(inputs)]
    v = vocab(name)
    assert (v.model, v.pre, len(inputs)) == (model, pre, n)
    bad = [
        (text, want, got)
        for text, line in zip(inputs, outputs)
        if (got := v.tokenize(text, add_special=False)) != (want := [int(x) for x in line.split()])
    ]
    assert bad == [], f"{len(bad)}/{n} differ; first: {bad[0]}"


@pytest.mark.parametrize("name", ["llama-bpe", "gemma-4", "bert-bge", "llama-spm", "nomic-bert-moe", "gpt-neox"])
def test_random_texts_match_libllama(name: str, tmp_path: Path) -> None:
    helper = check_tokenizers.build_helper(llama_src(), tmp_path)
    if helper is None:
        pytest.skip(f"no libllama.so in {check_tokenizers.llama_bin()} (build it with ../shared/tools/llama-cpp.sh)")
    r = check_tokenizers.compare(name, llama_src(), helper, 40, seed=3)
    assert (r.checked, r.bad_ids, r.bad_text) == (80, 0, 0), r.example


@pytest.mark.parametrize("pre", ["kimi-k2", "tekken", "afmoe"])
def test_more_pre_tokenizers_match_libllama(pre: str, tmp_path: Path) -> None:
    """Pre-tokenisers no test vocabulary uses, each on a copy of gpt-2's with its name."""
    helper = check_tokenizers.build_helper(llama_src(), tmp_path)
    if helper is None:
        pytest.skip(f"no libllama.so in {check_tokenizers.llama_bin()} (build it with ../shared/tools/llama-cpp.sh)")
    path = check_tokenizers.with_pre(llama_src() / "models" / "ggml-vocab-gpt-2.gguf", pre, tmp_path / "v.gguf")
    r = check_tokenizers.compare(pre, tmp_path, helper, 25, seed=8, path=path)
    assert (r.checked, r.bad_ids, r.bad_text) == (50, 0, 0), r.example


def test_unigram_normalises_and_adds_eos() -> None:
    v = vocab("nomic-bert-moe")  # t5: precompiled charsmap, extra whitespace removed, BOS and EOS added
    assert (v.kind, v.add_bos, v.add_eos) == ("UGM", True, True)
    ids = v.tokenize("  Hello   wörld  ")
    assert ids[0] == v.bos and ids[-1] == v.eos and v.detokenize(ids[1:-1]) == "Hello wörld"
    assert v.tokenize("ｈｅｌｌｏ", add_special=False) == v.tokenize("hello", add_special=False)  # NFKC
    assert v.tokenize("cafe\u0301 x", add_special=False) == v.tokenize("café x", add_special=False)  # a key after ASCII


def _plain_normalize(u: object, text: bytes) -> bytes:
    """llama.cpp's normalize loop, one prefix at a time: no plain runs, nothing remembered."""
    o = u._opt  # type: ignore[attr-defined]
    space = "\u2581".encode() if o.escape_whitespaces else b" "
    prepend, merge = not o.treat_whitespace_as_suffix and o.add_space_prefix, o.remove_extra_whitespaces
    out, prepended, in_word, at = bytearray(), False, False, 0
    while at < len(text):
        piece, used = u._normalize_prefix(text, at)  # type: ignore[attr-defined]
        for c in piece:
            if c != 0x20:
                if not in_word:
                    in_word = True
                    if (prepend and not prepended) or merge:
                        out += space
                        prepended = True
                out.append(c)
            else:
                in_word = False
                if not merge:
                    out += space
        at += used
    return bytes(out + space if o.treat_whitespace_as_suffix and o.add_space_prefix else out)


@pytest.mark.parametrize("merge", [True, False])
def test_unigram_shortcuts_change_nothing(merge: bool) -> None:
    """The remembered character normalisations, the normalisation on code points and the
    word-by-word Viterbi pass against the plain loops, on mixed text with spaces, newlines and characters the charsmap rewrites, twice
    (the second time from warm caches)."""
    u = vocab("nomic-bert-moe")._tok
    u._opt = replace(u._opt, remove_extra_whitespaces=merge)
    rng = random.Random(5)
    texts = [check_tokenizers.random_text(rng) for _ in range(60)]
    texts += ["ｈｅｌｌｏ  wörld\n\tcafe\u0301 x  ".encode(), "①②③ ﬁ ㌀ \u00a0 end ".encode()]
    texts += ["жи\u0306ла\u0301 йо\u0308ж e\u0301中 A\u030a\u0301 ｱﾞ\u3099 \u00a8\u0301".encode()]  # keys that go on
    texts += [check_tokenizers.mixed_text(20_000, seed=2).encode()]
    by_characters = 0
    for raw in texts * 2:
        got = u.normalize(raw)
        assert got == _plain_normalize(u, raw)
        assert u._encode(got) == u._viterbi(got)
        fast = u._normalize_text(raw.decode("utf-8", "surrogateescape"))  # None: bytes that are not UTF-8
        assert fast is None or fast == got
        by_characters += fast is not None
    assert len(u._chars) > 100 and u._cuts and by_characters > 40


def test_bpe_special_tokens_and_add_bos() -> None:
    v = vocab("llama-bpe")
    ids = v.tokenize("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", add_special=True, parse_special=True)
    assert ids[:2] == [128000, 128006] and ids[-1] == 128009  # llama-bpe: add_bos; specials parsed
    assert v.tokenize("<|eot_id|>", add_special=False) != [128009]  # not parsed: plain text
    assert v.is_eog(128009) and v.detokenize(ids, unparse_special=True).startswith("<|begin_of_text|><|start")
    assert v.nl == v.tokenize("\n", add_special=False)[0]


def test_byte_level_pieces_are_bytes_not_stored_text() -> None:
    v = vocab("gpt-2")
    (tok,) = v.tokenize(" café", add_special=False)[-1:]
    assert v.token_text(tok) != v.token_to_piece(tok).decode()  # stored text is the byte encoding
    ids = v.tokenize("naïve 🦙 日本", add_special=False)
    assert b"".join(v.token_to_piece(t) for t in ids) == "naïve 🦙 日本".encode()
    streamer = TokenStreamer(v)  # a character split across tokens is held until complete
    out = [streamer.push(t) for t in v.tokenize("🦙", add_special=False)]
    assert "".join(out) == "🦙" and "\ufffd" not in "".join(out) and out[-1] == "🦙"


def test_wordpiece_cls_sep_lowercase_and_unknown() -> None:
    v = vocab("bert-bge")
    ids = v.tokenize("Hello, WORLD!", add_special=True)
    assert (
        ids[0] == 101 and ids[-1] == 102 and v.detokenize(ids[1:-1]) == " hello, world!"
    )  # llama.cpp keeps the ▁ of the first word
    assert v.tokenize("\u0f00\u0f01", add_special=False) == [v.unk]  # no piece covers it


def test_gemma4_spaces_and_newlines() -> None:
    v = vocab("gemma-4")
    assert v.add_bos and v.tokenize("a")[0] == v.bos
    text = "Hello  world\n\n\nbye   "
    assert v.detokenize(v.tokenize(text, add_special=False)) == text


def test_every_pre_tokenizer_compiles_and_splits() -> None:
    text = "Hello world's 12345 日本語 👋\n\n  x"
    for name, pre in PRE_TOKENIZERS.items():
        if pre.type in UNSUPPORTED_PRE:
            continue
        assert "".join(Splitter(pre.type).words(text)) == text, name  # words cover the text, in order


def test_joined_steps_cut_as_piece_by_piece() -> None:
    """A step whose regex cannot cross NUL runs once over the words joined with NUL; it must cut
    exactly as running it on each word alone (and "\\s+$" as each word's trailing space)."""
    from ubatch.engine.vocab.pre_tokenizer import _VIEWS

    rng = random.Random(5)
    alphabet = "ab Z9٣\t\n\r  ,.!?'日本한😀é\u0301-_$+<>\u00a0\u3000\U0002ebf0"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(60))) for _ in range(150)]
    for pre in {p.type for p in PRE_TOKENIZERS.values()} - set(UNSUPPORTED_PRE):
        splitter = Splitter(pre)
        for text in texts:
            pieces, view = [text], text
            for step in splitter.steps:  # the slow reference: every step on every piece alone
                s = _VIEWS[step.view](text)
                if s is not view:
                    pieces, view = _cut_like(s, pieces), s
                pieces = [w for p in pieces for w in step.pieces(p)]
            want = pieces if view is text else _cut_like(text, pieces)
            assert splitter.words(text) == want, (pre, text)


def _cut_like(s: str, pieces: list[str]) -> list[str]:
    """`s` cut into parts as long as `pieces`."""
    out, at = [], 0
    for p in pieces:
        out.append(s[at : at + len(p)])
        at += len(p)
    return out


def test_digit_groups_join_the_text_before_them() -> None:
    digits = Splitter("AFMOE").steps[0]  # \p{AFMoE_digits}: llama.cpp's custom splitter
    assert digits.pattern is None and digits.pieces("ab1234567 x") == ["ab1", "234", "567", " x"]
    assert Splitter("TINY_AYA").words("ab1234567 x") == ["ab", "1", "234", "567", " x"]  # its next regex


def test_unknown_pre_falls_back_to_default_and_missing_pre_warns() -> None:
    meta = dict(open_gguf(llama_src() / "models" / "ggml-vocab-gpt-2.gguf").metadata)
    text = "Hello  world's 12345 ünïcode\n\n  x"
    default = Vocab.from_metadata({**meta, "tokenizer.ggml.pre": "default"}, "x")
    v = Vocab.from_metadata({**meta, "tokenizer.ggml.pre": "nope"}, "x")
    assert v.pre == "default" and v.warnings[0].startswith("unknown pre-tokenizer type 'nope'")
    assert v.tokenize(text) == default.tokenize(text) != vocab("gpt-2").tokenize(text)
    v = Vocab.from_metadata({k: x for k, x in meta.items() if k != "tokenizer.ggml.pre"}, "x")
    assert v.pre == "default" and "tokenizer.ggml.pre" in v.warnings[0]


def test_tokenize_cli_warns_on_unknown_pre_and_reads_bytes_that_are_not_utf8(
    tmp_path: Path, odd_bpe_model: str
) -> None:
    """`ubatch tokenize`: the vocabulary's warnings as llama.cpp's `load:` lines on stderr; -p, -f
    and --stdin bytes that are not UTF-8 tokenized as llama-tokenize does them, as is Llama.tokenize."""
    from cli_inproc import run_cli

    from ubatch.llama import Llama

    src = llama_src() / "models" / "ggml-vocab-gpt-2.gguf"
    r = run_cli(["tokenize", "-m", odd_bpe_model, "-p", "Hello world", "--ids"])
    assert r.returncode == 0 and r.stderr.startswith("load: unknown pre-tokenizer type 'nope-v9'"), r.stderr
    raw = b"caf\xe9 \xff\xfe ok \xc3\xa9\x80 \xe2\x82"  # Latin-1, stray and cut-off bytes
    (tmp_path / "in.txt").write_bytes(raw)
    runs = [
        run_cli(["tokenize", "-m", str(src), "-p", raw.decode("utf-8", "surrogateescape"), "--ids"]),
        run_cli(["tokenize", "-m", str(src), "-f", str(tmp_path / "in.txt"), "--ids"]),
    ]
    assert [(x.returncode, x.stderr) for x in runs] == [(0, ""), (0, "")]
    ids = json.loads(runs[0].stdout)
    assert json.loads(runs[1].stdout) == ids
    assert Llama.tokenize(SimpleNamespace(vocab=vocab("gpt-2")), raw, False) == ids  # type: ignore[arg-type]
    helper = check_tokenizers.build_helper(llama_src(), tmp_path)
    if helper is not None:  # llama.cpp's own ids for the same bytes
        llama = check_tokenizers.LlamaTokenizer(helper, src)
        try:
            assert llama.run(raw, False, True)[0] == ids
        finally:
            llama.close()


@pytest.fixture(scope="module")
def odd_bpe_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama with gpt-2's vocabulary, its tokenizer.ggml.pre an unknown name ('nope-v9')."""
    import gguf
    import tiny_models

    src = gguf.GGUFReader(llama_src() / "models" / "ggml-vocab-gpt-2.gguf")
    keys = {k: f for k, f in src.fields.items() if k.startswith("tokenizer.")}
    tokens = keys["tokenizer.ggml.tokens"].contents()

    def bpe_keys(w: gguf.GGUFWriter, rng: object) -> None:  # in place of the tiny SPM keys
        for k, f in keys.items():
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.kv_data[0][k] = gguf.GGUFValue(f.contents(), f.types[0], sub)
        w.kv_data[0]["tokenizer.ggml.pre"] = gguf.GGUFValue("nope-v9", gguf.GGUFValueType.STRING)

    spec = tiny_models.TinySpec(
        arch="llama", n_layer=1, vocab=(tokens, [0.0] * len(tokens), [1] * len(tokens)), extra=bpe_keys
    )
    return str(tiny_models.write_tiny_model(tmp_path_factory.mktemp("odd") / "tiny-bpe.gguf", spec))


def test_model_logs_show_the_vocabulary_warnings(odd_bpe_model: str) -> None:
    """`ubatch cli` and `bench` on that model: llama.cpp's `load:` line in the startup log (a
    bench note)."""
    from cli_inproc import run_cli

    m = odd_bpe_model
    line = "load: unknown pre-tokenizer type 'nope-v9' (tokenizer.ggml.pre); using 'default'"
    r = run_cli(["cli", "-m", m, "-p", "Hello", "-n", "2", "--temp", "0", "-c", "64", "-no-cnv"])
    assert r.returncode == 0 and line in r.stderr, r.stderr[-2000:]
    r = run_cli(["bench", "-m", m, "-p", "8", "-n", "0", "-r", "1"])
    assert r.returncode == 0 and f"note: {line}" in " ".join(r.stderr.split()), r.stderr[-2000:]


def test_clean_spaces_passes() -> None:
    assert clean_spaces(b"Hello , world ! It ' s you 're 't") == b"Hello, world! It's you're 't"
    assert clean_spaces(b"a ' b") == b"a'b" and clean_spaces(b"") == b""
    v = vocab("gpt-2")  # clean_spaces on: llama.cpp's detokenize drops " ," etc.
    assert v.detokenize(v.tokenize("a , b", add_special=False)) == "a, b"


def test_lstrip_rstrip_partition() -> None:
    groups = group_specials([7], {7: "<m>"})
    assert partition("a  <m>  b", groups, {7: (True, False)}) == ["a", 7, "  b"]
    assert partition("a  <m>  b", groups, {7: (False, True)}) == ["a  ", 7, "b"]
    assert partition("a  <m>  b", groups) == ["a  ", 7, "  b"]


def test_byte_encoding_round_trips_every_byte() -> None:
    raw = bytes(range(256))
    word = raw.decode("latin-1")
    assert byte_decode(byte_encode(word)) == word.encode()
    assert byte_decode("\u4e00") == b"[UNK_BYTE_0xe4b880\xe4\xb8\x80]"


def test_invalid_utf8_decodes_as_llama_cpp() -> None:
    bad = b"a\xe4\xb8b\xff".decode("utf-8", "surrogateescape")
    assert llama_text(bad) == "a\ufffd\ufffdb\ufffd"  # each bad byte one U+FFFD


def test_word_cache_keeps_ids_and_stays_bounded() -> None:
    v = vocab("qwen2")
    rng = random.Random(0)
    words = " ".join("".join(rng.choice("abcdefgh") for _ in range(6)) for _ in range(3000))
    first = v.tokenize(words, add_special=False)
    assert v.tokenize(words, add_special=False) == first  # second time from the cache


@pytest.mark.parametrize("name", ["llama-bpe", "gemma-4", "bert-bge"])
def test_consumers_read_pieces_not_stored_texts(name: str) -> None:
    """The grammar's token trie and DRY's sequence breakers see each token as the text it prints
    (byte-level BPE's stored text "Ġthe" is " the"), whatever the kind."""
    from ubatch.engine.grammar.tokens import token_table
    from ubatch.engine.sampling.dry import breaker_table

    v = vocab(name)
    word = " world" if v.kind == "BPE" else "world"
    (tok,) = v.tokenize(word, add_special=False)[-1:]
    key, _, _ = token_table(v).decoded(tok) or ("", 0, 0)
    assert key == v.token_to_piece(tok).decode() and key.strip() == "world"
    (colon,) = v.tokenize(":", add_special=False)[-1:]
    assert () in breaker_table(v, (":",))[colon]  # the ":" token completes the ":" breaker by itself


@pytest.mark.parametrize("name", ["llama-bpe", "gemma-4", "gpt-2", "falcon", "bert-bge", "nomic-bert-moe"])
def test_native_loops_give_the_python_loops_ids(name: str) -> None:
    """The C loops (native.py, csrc/words.c) against the Python ones, on mixed and random texts
    (bytes that are not UTF-8 included); for BPE also a word longer than the C merge loop takes."""
    from ubatch.engine.vocab.native import NativeBpe, library

    if library() is None:
        pytest.skip("no C compiler: the Python loops run")
    v = Vocab.from_metadata(open_gguf(llama_src() / "models" / f"ggml-vocab-{name}.gguf").metadata, name)
    t = v._tok
    rng = random.Random(11)
    texts = [check_tokenizers.mixed_text(60_000, seed=4), "ab" * 2500 + " \U0001fae0\u4e00" * 40 + "\x00\x01"]
    texts += [check_tokenizers.random_text(rng).decode("utf-8", "surrogateescape") for _ in range(300)]
    native = [v.tokenize(x, parse_special=True) for x in texts]
    assert t._native  # built, and used above
    t._native = False
    t._cache.clear()
    assert [v.tokenize(x, parse_special=True) for x in texts] == native
    if v.kind == "BPE":  # a merge of texts that are not tokens: only the Python loop merges by text
        merges = StringArray.from_strings(["a b"])
        assert NativeBpe.build(StringArray.from_strings(["a", "b"]), merges, [-1] * 256) is None
        assert NativeBpe.build(StringArray.from_strings(["a", "b", "ab"]), merges, [-1] * 256)
