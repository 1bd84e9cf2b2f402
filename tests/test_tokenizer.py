"""The SPM tokenizer gives llama.cpp's ids and text, on Gemma 3 270M and on a tiny vocab."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import gguf
import pytest
from tiny_vocab import BOS, BYTE0, END_OF_TURN, EOS, NEWLINE, START_OF_TURN, UNK, piece_id, tiny_spm_vocab

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.file import open_gguf
from ubatch.engine.vocab.token_stream import TokenStreamer
from ubatch.engine.vocab.vocab import Vocab

REF_ROWS = [
    json.loads(line) for line in (Path(__file__).parent / "refdata" / "tokenize.jsonl").read_text().splitlines()
]


@pytest.fixture(scope="module")
def gemma_metadata(default_model_path: Path) -> dict:
    return open_gguf(default_model_path).metadata


@pytest.fixture(scope="module")
def gemma(gemma_metadata: dict) -> Vocab:
    return Vocab.from_metadata(gemma_metadata, "gemma-3-270m")


# ---- Gemma 3 270M against llama.cpp ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ids_special", "ids_plain", "ids_nobos", "detok"])
def test_every_reference_string_matches_llama_cpp(gemma: Vocab, variant: str) -> None:
    def ours(text: str, ids_nobos: list[int]) -> object:
        if variant == "detok":
            return gemma.detokenize(ids_nobos)
        add_special, parse_special = {
            "ids_special": (True, True),
            "ids_plain": (True, False),
            "ids_nobos": (False, False),
        }[variant]
        return gemma.tokenize(text, add_special=add_special, parse_special=parse_special)

    bad = [r["text"] for r in REF_ROWS if ours(r["text"], r["ids_nobos"]) != r[variant]]
    assert len(REF_ROWS) == 88 and bad == []


TABLE = [  # reference/gguf-models.md §7 (BOS on, parse_special on unless stated)
    ("Hello world", True, True, [2, 9259, 1902]),
    (" Hello world", True, True, [2, 26352, 1902]),
    ("Hello  world", True, True, [2, 9259, 138, 12392]),
    ("Hello   world\n\nBye", True, True, [2, 9259, 139, 12392, 108, 98874]),
    ("The capital of France is", True, True, [2, 818, 5279, 529, 7001, 563]),
    ("1234567890", True, True, [2, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771]),
    ("naïve café 日本語 🙂", True, True, [2, 1789, 238527, 560, 33443, 33375, 238582, 57235]),
    ("\t\tindent", True, True, [2, 255969, 32699]),
    ("a\nb\n\n\nc", True, True, [2, 236746, 107, 236763, 109, 236755]),
    ("", True, True, [2]),
    (" ", True, True, [2, 236743]),
    ("\x00\x01", True, True, [2, 238, 249732]),
    ("x<end_of_turn>y", True, True, [2, 236781, 106, 236762]),
    ("x<end_of_turn>y", False, False, [236781, 236820, 643, 236779, 1340, 236779, 887, 236813, 236762]),
    (
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        True,
        True,
        [2, 105, 2364, 107, 3689, 563, 236743, 236778, 236862, 236778, 236881, 106, 107, 105, 4368, 107],
    ),
    (
        "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n",
        True,
        True,
        [2, 105, 2364, 107, 3912, 8652, 236761, 108, 10979, 993, 106, 107, 105, 4368, 107],
    ),
    ("<start_of_turn>", False, False, [236820, 3041, 236779, 1340, 236779, 887, 236813]),
    ("</s>", True, True, [2, 212]),
    ("</s>", False, False, [954, 236751, 236813]),
    ("<bos>hi", True, True, [2, 2, 2202]),  # double BOS: llama.cpp only warns
]


@pytest.mark.slow
@pytest.mark.parametrize("text, add_special, parse_special, ids", TABLE)
def test_reference_table(gemma: Vocab, text: str, add_special: bool, parse_special: bool, ids: list[int]) -> None:
    assert gemma.tokenize(text, add_special, parse_special) == ids


@pytest.mark.slow
def test_special_tokens_and_eog_as_llama_cpp_reports_them(gemma: Vocab) -> None:
    v = gemma
    assert (v.n_tokens, v.bos, v.eos, v.eot, v.unk, v.pad) == (262144, 2, 1, 106, 3, 0)
    assert v.eog == {1, 106, 212} and v.is_eog(212) and not v.is_eog(2)
    assert v.nl == 248  # llama_vocab_nl is the <0x0A> byte token, though "\n" tokenises to 107
    assert (v.add_bos, v.add_eos, v.add_space_prefix) == (True, False, False)
    texts = {105: "<start_of_turn>", 106: "<end_of_turn>", 107: "\n", 248: "<0x0A>", 236743: "▁"}
    assert {i: v.token_text(i) for i in texts} == texts


@pytest.mark.slow
def test_detokenize_hides_control_tokens_unless_asked(gemma: Vocab) -> None:
    ids = [2, 9259, 138, 12392, 108, 98874]
    assert gemma.detokenize(ids) == "Hello  world\n\nBye"
    assert gemma.detokenize(ids, unparse_special=True) == "<bos>Hello  world\n\nBye"
    assert gemma.detokenize(ids, remove_special=True, unparse_special=True).startswith("Hello")
    # </s> is user-defined in the file but forced to CONTROL as an EOG text: hidden by default
    assert gemma.token_to_piece(212) == b"" and gemma.token_to_piece(212, special=True) == b"</s>"
    assert gemma.token_to_piece(238) == b"\x00" and gemma.token_to_piece(26352) == b" Hello"


@pytest.mark.slow
def test_streamer_holds_back_characters_split_over_byte_tokens(gemma: Vocab) -> None:
    text = "\x00\x01 日本語 🙂 𓀀ꙮ!"  # 𓀀 and ꙮ are not in the vocab: 4 and 3 byte tokens
    ids = gemma.tokenize(text, add_special=False)
    assert [i for i in ids if 238 <= i < 494] == [238, 478, 385, 366, 366, 472, 391, 412]
    streamer = TokenStreamer(gemma)
    pieces = [streamer.push(i) for i in ids]
    assert "".join(pieces) + streamer.flush() == gemma.detokenize(ids) == text
    assert pieces.count("") >= 5  # nothing is emitted until a character is complete


@pytest.mark.slow
def test_python_merge_loop_agrees_with_sentencepiece(gemma: Vocab, gemma_metadata: dict) -> None:
    py = Vocab.from_metadata(gemma_metadata, "gemma-3-270m", use_sentencepiece=False)
    sp = Vocab.from_metadata(gemma_metadata, "gemma-3-270m", sp_min_chars=0)  # sentencepiece for short texts too
    rng = random.Random(0)
    mixed = "".join(rng.choice(["the", " ", "  ", "\n", "日本", "🙂", "<end_of_turn>", "é", "x"]) for _ in range(3000))
    for text in [r["text"] for r in REF_ROWS] + [mixed]:
        for flags in [(True, True), (False, False)]:
            assert py.tokenize(text, *flags) == sp.tokenize(text, *flags) == gemma.tokenize(text, *flags), text


@pytest.mark.slow
def test_a_5000_token_prompt_tokenizes_quickly(gemma: Vocab) -> None:
    text = "".join(
        f"<start_of_turn>user\nItem {i}: the number {i} squared is {i * i}.\n<end_of_turn>\n" for i in range(250)
    )
    t0 = time.perf_counter()
    ids = gemma.tokenize(text, parse_special=True)
    assert len(ids) > 5000 and time.perf_counter() - t0 < 0.25


# ---- a tiny vocabulary worked by hand ----------------------------------------------------------


def write_vocab(path: Path, model: str = "llama", add_space_prefix: bool = True, drop_bytes: bool = False) -> Path:
    tokens, scores, types = tiny_spm_vocab()
    if drop_bytes:
        keep = [i for i, t in enumerate(types) if t != 6]
        tokens, scores, types = ([x[i] for i in keep] for x in (tokens, scores, types))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(UNK)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny(tmp_path: Path, **kw: object) -> Vocab:
    path = write_vocab(tmp_path / "tiny.gguf", **kw)  # type: ignore[arg-type]
    return Vocab.from_metadata(open_gguf(path).metadata, str(path))


def test_tiny_vocab_merges_by_score(tmp_path: Path) -> None:
    v = tiny(tmp_path)
    assert v._sp is not None  # this vocab goes through sentencepiece
    p = piece_id
    # " the world" -> ▁ t h e ▁ w o r l d: ▁t(0) he(-1) ▁the(-2) ▁w(-6) or(-7) ld(-8) ▁wor ▁world
    assert v.tokenize("the world") == [BOS, p("▁the"), p("▁world")]
    # ▁ h e l l o: he(-1) ll(-11); the queued ▁h(-12) is stale by then; ▁he(-13) llo(-14) ▁hello
    assert v.tokenize("hello", add_special=False) == [p("▁hello")]
    # é is not a piece: its two UTF-8 bytes become byte tokens
    assert v.tokenize("thé", add_special=False) == [p("▁t"), p("h"), BYTE0 + 0xC3, BYTE0 + 0xA9]
    assert v.tokenize("") == [BOS] and v.tokenize("", add_special=False) == []


def test_tiny_vocab_special_tokens_and_space_prefix(tmp_path: Path) -> None:
    v, p = tiny(tmp_path), piece_id
    text = "<start_of_turn>the<end_of_turn>\nhello"
    # a space is prefixed at the start and after every special token, "\n" (user-defined) too
    assert v.tokenize(text, parse_special=True) == [BOS, START_OF_TURN, p("▁the"), END_OF_TURN, NEWLINE, p("▁hello")]
    plain = v.tokenize(text, parse_special=False)
    assert START_OF_TURN not in plain and END_OF_TURN not in plain and NEWLINE in plain
    assert (v.eot, v.eog) == (END_OF_TURN, {EOS, END_OF_TURN})
    no_prefix = tiny(tmp_path, add_space_prefix=False)
    assert no_prefix.tokenize("the", add_special=False) == [p("t"), p("he")]


def test_tiny_vocab_detokenize(tmp_path: Path) -> None:
    v, p = tiny(tmp_path), piece_id
    ids = [p("▁the"), p("▁world")]
    assert v.detokenize(ids) == "the world"  # add_space_prefix: the first space is stripped
    assert v.detokenize([BOS, *ids]) == " the world"  # ...from the first piece only (<bos>)
    assert v.detokenize([BOS, *ids], remove_special=True) == " the world"  # llama.cpp keeps it
    assert v.detokenize([p("▁t"), p("h"), BYTE0 + 0xC3, BYTE0 + 0xA9]) == "thé"
    assert v.detokenize([BYTE0 + 0xC3]) == "\ufffd"
    assert v.detokenize([START_OF_TURN, NEWLINE], unparse_special=True) == "<start_of_turn>\n"
    streamer = TokenStreamer(v)
    assert [streamer.push(t) for t in (p("▁t"), BYTE0 + 0xC3, BYTE0 + 0xA9)] == [" t", "", "é"]
    assert streamer.push(BYTE0 + 0xC3) == "" and streamer.flush() == "\ufffd"


def test_tiny_vocab_both_merge_loops_agree(tmp_path: Path) -> None:
    tiny(tmp_path)
    sp = Vocab.from_metadata(open_gguf(tmp_path / "tiny.gguf").metadata, sp_min_chars=0)  # sentencepiece always
    py = Vocab.from_metadata(open_gguf(tmp_path / "tiny.gguf").metadata, use_sentencepiece=False)
    rng = random.Random(1)
    for _ in range(200):
        text = "".join(rng.choice("the world hello ☃\n<>_") for _ in range(rng.randrange(40)))
        assert sp.tokenize(text, True, True) == py.tokenize(text, True, True), repr(text)


def test_vocab_without_byte_tokens_uses_the_python_loop(tmp_path: Path) -> None:
    v, p = tiny(tmp_path, drop_bytes=True), piece_id
    assert v._sp is None
    unk = v.unk
    ids = v.tokenize("the world é", add_special=False)
    # ids shift down by 256 after the dropped byte tokens; é's bytes fall back to <unk>
    assert ids == [p("▁the") - 256, p("▁world") - 256, p("▁") - 256, unk, unk]


@pytest.mark.parametrize("model, words", [("rwkv", "RWKV"), ("plamo2", "PLaMo2"), ("hybriddna", "BPE with DNA k-mers")])
def test_unsupported_tokenizer_is_a_load_error(tmp_path: Path, model: str, words: str) -> None:
    with pytest.raises(ModelLoadError, match=rf"tiny\.gguf: tokenizer '{model}' \({words}\)"):
        tiny(tmp_path, model=model)


def test_bpe_vocab_without_merges_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: the BPE vocabulary has no merges"):
        tiny(tmp_path, model="gpt2")


def test_missing_tokenizer_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="m.gguf: no tokenizer"):
        Vocab.from_metadata({"general.architecture": "llama"}, "m.gguf")
