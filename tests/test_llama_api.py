"""The llama-cpp-python style API: `from ubatch import Llama`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ubatch import Llama
from ubatch.engine.errors import ContextError

PROMPT = "The capital of France is"
GREEDY8 = " the capital of the country of France."  # llama.cpp's greedy 8 tokens (refdata)


# -- tiny models: tokenizer round trip and eval/scores --------------------------------------------


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def tiny(request: pytest.FixtureRequest, tiny_gemma: Path, tiny_llama: Path) -> Llama:
    path = tiny_gemma if request.param == "gemma3" else tiny_llama
    # f32 KV cache: evaluations with different batch shapes then agree to float rounding
    return Llama(model_path=str(path), n_ctx=256, logits_all=True, type_k="f32", type_v="f32")


TEXT = b"Hello world, how are you? the hello"


def test_tokenize_detokenize_round_trip(tiny: Llama) -> None:
    ids = tiny.tokenize(TEXT)
    assert ids[0] == tiny.token_bos() == 2
    assert all(isinstance(t, int) for t in ids)
    out = tiny.detokenize(ids)
    assert isinstance(out, bytes)
    assert out == TEXT  # a leading BOS drops the SPM space prefix, as llama-cpp-python does
    no_bos = tiny.tokenize(TEXT, add_bos=False)
    assert no_bos == ids[1:]
    # without BOS the pieces come back as they are (llama's space prefix included)
    space = b" " if tiny.vocab.add_space_prefix else b""
    assert tiny.detokenize(no_bos) == space + TEXT
    assert tiny.detokenize([]) == b""


def test_tokenize_special(tiny: Llama) -> None:
    text = b"a<end_of_turn>b"
    plain = tiny.tokenize(text, add_bos=False, special=False)
    special = tiny.tokenize(text, add_bos=False, special=True)
    assert 5 in special and 5 not in plain  # <end_of_turn> is id 5 in the tiny vocabulary
    assert b"<end_of_turn>" in tiny.detokenize(plain)  # plain text
    assert b"<end_of_turn>" not in tiny.detokenize(special)  # a control token prints nothing...
    assert b"<end_of_turn>" in tiny.detokenize(special, special=True)  # ...unless asked


def test_accessors(tiny: Llama) -> None:
    assert tiny.n_ctx() == 256
    assert tiny.n_vocab() == 326
    assert tiny.token_eos() == 1
    assert tiny.scores.shape == (256, 326)


def test_eval_scores_match_fresh_eval_of_each_prefix(tiny: Llama) -> None:
    ids = tiny.tokenize(TEXT)
    n = len(ids)
    tiny.reset()
    tiny.eval(ids)
    assert tiny.n_tokens == n
    assert list(tiny.input_ids[:n]) == ids
    full = tiny.scores[:n].copy()
    assert np.isfinite(full).all()
    assert np.abs(full).max() > 1.0
    for k in (1, 4, n - 1):
        tiny.reset()
        tiny.eval(ids[:k])
        assert tiny.n_tokens == k
        np.testing.assert_allclose(tiny.scores[:k], full[:k], atol=1e-4, rtol=0)
    # positions matter: row i is the prediction after ids[:i + 1], different for each i
    assert not np.allclose(full[1], full[2], atol=1e-2)


def test_eval_in_parts_equals_eval_at_once(tiny: Llama) -> None:
    ids = tiny.tokenize(TEXT)
    n = len(ids)
    tiny.reset()
    tiny.eval(ids)
    once = tiny.scores[:n].copy()
    tiny.reset()
    tiny.eval(ids[:3])
    tiny.eval(ids[3:7])
    tiny.eval(ids[7:])
    assert tiny.n_tokens == n
    np.testing.assert_allclose(tiny.scores[:n], once, atol=1e-4, rtol=0)
    # rewinding n_tokens re-evaluates from there: the cache drops what came after
    tiny.n_tokens = 5
    tiny.eval(ids[5:])
    np.testing.assert_allclose(tiny.scores[:n], once, atol=1e-4, rtol=0)
    # a different token at position 5 changes the rows from 5 on, not before
    tiny.n_tokens = 5
    other = ids[:5] + [ids[6]] + ids[6:]
    tiny.eval(other[5:])
    np.testing.assert_allclose(tiny.scores[:5], once[:5], atol=1e-4, rtol=0)
    assert np.abs(tiny.scores[5] - once[5]).max() > 1e-2


def test_eval_past_context_raises(tiny: Llama) -> None:
    tiny.reset()
    with pytest.raises(ContextError):
        tiny.eval([2] * 257)


def test_prompt_longer_than_context_raises(tiny: Llama) -> None:
    long_prompt = "hello " * 300
    assert len(tiny.tokenize(long_prompt.encode())) > 256
    with pytest.raises(ContextError, match="256"):
        tiny.create_completion(long_prompt, max_tokens=4, temperature=0)


def test_completion_ending_at_eog_keeps_held_back_text(tiny: Llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """Text held back for a possible stop string is still returned when generation ends (EOG)."""
    calls = {"n": 0}

    def is_eog(tok: int) -> bool:  # the 3rd sampled token ends the generation
        calls["n"] += 1
        return calls["n"] % 3 == 0

    plain = tiny.create_completion("Hello world", max_tokens=10, temperature=0)["choices"][0]["text"]
    monkeypatch.setattr(type(tiny.vocab), "is_eog", lambda self, tok: is_eog(tok))
    r = tiny.create_completion("Hello world", max_tokens=10, temperature=0)
    two = r["choices"][0]["text"]
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == 2
    assert len(two) > 3 and plain.startswith(two)
    for stop in (["zzzz"], ["q", "xyzzy"]):
        r = tiny.create_completion("Hello world", max_tokens=10, temperature=0, stop=stop)
        assert r["choices"][0]["text"] == two
        assert r["choices"][0]["finish_reason"] == "stop"
        chunks = list(tiny.create_completion("Hello world", max_tokens=10, temperature=0, stop=stop, stream=True))
        assert "".join(c["choices"][0]["text"] for c in chunks) == two


# -- the default model: create_completion --------------------------------------------------------


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Llama:
    return Llama(model_path=str(default_model_path), n_ctx=512)


@pytest.mark.slow
def test_completion_greedy_openai_shape(llm: Llama) -> None:
    r = llm.create_completion(PROMPT, max_tokens=8, temperature=0)
    assert set(r) >= {"id", "object", "created", "model", "choices", "usage"}
    assert r["id"].startswith("cmpl-")
    assert r["object"] == "text_completion"
    assert isinstance(r["created"], int) and r["created"] > 1_600_000_000
    assert r["model"] == llm.model_path
    assert len(r["choices"]) == 1
    c = r["choices"][0]
    assert c["text"] == GREEDY8
    assert c["index"] == 0
    assert c["logprobs"] is None
    assert c["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
    assert llm(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"] == GREEDY8  # __call__


@pytest.mark.slow
def test_completion_token_ids_prompt(llm: Llama) -> None:
    ids = [2, 818, 5279, 529, 7001, 563]
    assert llm.tokenize(PROMPT.encode(), special=True) == ids
    r = llm.create_completion(ids, max_tokens=4, temperature=0)
    assert r["choices"][0]["text"] == " the capital of the"
    assert r["usage"]["prompt_tokens"] == 6


@pytest.mark.slow
def test_completion_stop_string(llm: Llama) -> None:
    r = llm.create_completion(PROMPT, max_tokens=8, temperature=0, stop=["France"])
    assert r["choices"][0]["text"] == " the capital of the country of "
    assert r["choices"][0]["finish_reason"] == "stop"
    r = llm.create_completion(PROMPT, max_tokens=8, temperature=0, stop="country")
    assert r["choices"][0]["text"] == " the capital of the "
    # a stop string that never appears changes nothing
    r = llm.create_completion(PROMPT, max_tokens=8, temperature=0, stop=["Paris", "zz"])
    assert r["choices"][0]["text"] == GREEDY8
    assert r["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_completion_stream(llm: Llama) -> None:
    chunks = list(llm.create_completion(PROMPT, max_tokens=8, temperature=0, stream=True))
    assert len(chunks) >= 8
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == GREEDY8
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    chunks = list(llm.create_completion(PROMPT, max_tokens=8, temperature=0, stream=True, stop=["France"]))
    assert "".join(c["choices"][0]["text"] for c in chunks) == " the capital of the country of "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
def test_completion_echo(llm: Llama) -> None:
    r = llm.create_completion(PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r["choices"][0]["text"] == PROMPT + " the capital of"


@pytest.mark.slow
def test_completion_logprobs(llm: Llama) -> None:
    r = llm.create_completion(PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == GREEDY8
    assert set(lp) >= {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == GREEDY8
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    for tok, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0.0
        assert 1 <= len(top) <= 2
        best = max(top, key=top.get)
        assert best == tok  # greedy: the chosen token is the most likely
        assert top[best] == pytest.approx(logprob)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][0] == 0


@pytest.mark.slow
def test_completion_seeded_sampling_is_reproducible(llm: Llama) -> None:
    a = llm.create_completion(PROMPT, max_tokens=6, temperature=1.0, seed=7)["choices"][0]["text"]
    b = llm.create_completion(PROMPT, max_tokens=6, temperature=1.0, seed=7)["choices"][0]["text"]
    assert a == b


@pytest.mark.slow
def test_completion_reuses_prefix(llm: Llama) -> None:
    perf = llm.ctx.perf

    def decoded() -> int:
        return perf.n_p_eval + perf.n_eval

    llm.create_completion("Once upon a time,", max_tokens=2, temperature=0)  # something else first
    d0 = decoded()
    first = llm.create_completion(PROMPT, max_tokens=8, temperature=0)
    d1 = decoded()
    second = llm.create_completion(PROMPT, max_tokens=8, temperature=0)
    d2 = decoded()
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == GREEDY8
    # first: the 5 prompt tokens after the shared <bos>, then 7 generated ones (the 8th is sampled,
    # never evaluated); second: only the last prompt token again (its logits are needed) + 7
    assert d1 - d0 == 5 + 7
    assert d2 - d1 == 1 + 7
    # a longer prompt sharing the prefix evaluates only its new tokens
    llm.create_completion(PROMPT + " Paris", max_tokens=1, temperature=0)
    assert decoded() - d2 == len(llm.tokenize((PROMPT + " Paris").encode())) - 6


@pytest.mark.slow
def test_default_model_prompt_too_long(llm: Llama) -> None:
    with pytest.raises(ContextError):
        llm.create_completion("hello " * 600, max_tokens=1)
