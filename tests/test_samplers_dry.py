"""DRY (engine/sampler_dry.py) against a brute-force reference on crafted and random histories,
its sequence breakers (as tokens and as text matched against a real vocabulary), its window
(dry_penalty_last_n, -1 = the context) and the exponent clamp.

The reference is the definition, not the Z-algorithm: a token that followed an earlier end of
the history's last L tokens would extend a repeat of length L (L capped at the tokens since the
latest sequence breaker); its logit loses multiplier * base^(L - allowed_length).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.sampling.dry import Dry, breaker_table
from ubatch.engine.sampling.stages import Cands


def dry_ref(hist: list[int], mult: float, base: float, allowed: int, breakers: dict) -> dict[int, float]:
    n = len(hist)
    if n <= allowed:
        return {}
    limit = n
    for start in range(n - 1, -1, -1):  # the latest breaker head with a complete tail
        tails = [t for t in breakers.get(hist[start], []) if list(hist[start + 1 : start + 1 + len(t)]) == list(t)]
        tails = [t for t in tails if start + len(t) <= n - 1]
        if tails:
            limit = n - 1 - start - max(len(t) for t in tails)
            break
    if limit < allowed:
        return {}
    longest: dict[int, int] = {}
    for i in range(n - 1):  # an earlier position; hist[i + 1] followed it
        m = 0
        while m <= i and hist[i - m] == hist[n - 1 - m]:
            m += 1
        m = min(m, limit)
        if m >= allowed:
            longest[hist[i + 1]] = max(longest.get(hist[i + 1], -1), m)
    single = {tok for tok, tails in breakers.items() if () in tails}
    return {t: mult * base ** (m - allowed) for t, m in longest.items() if t not in single}


def penalties_of(hist: list[int], mult: float = 0.8, base: float = 1.75, allowed: int = 2, breakers=None) -> dict:
    d = Dry(mult, base, allowed, None, breakers or {})
    for t in hist:
        d.accept(t)
    return d.penalties() or {}


def test_crafted_history() -> None:
    # a b c c b c y a b c: "a b c" ends at position 2 (then c), "b c" at 5 (then y), "c" at 3
    a, b, c, y = 1, 2, 3, 4
    hist = [a, b, c, c, b, c, y, a, b, c]
    got = penalties_of(hist, allowed=2)
    assert got == pytest.approx({c: 0.8 * 1.75**1, y: 0.8 * 1.75**0})  # c extends 3 tokens, y 2
    assert penalties_of(hist, allowed=1) == pytest.approx({c: 0.8 * 1.75**2, y: 0.8 * 1.75, b: 0.8})
    assert penalties_of(hist, allowed=4) == {}


@pytest.mark.parametrize("seed", range(6))
def test_random_histories_match_the_brute_force_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    alphabet = 3 + seed % 3
    hist = rng.integers(0, alphabet, size=60 + 10 * seed).tolist()
    breakers = {0: [()]} if seed % 2 else {1: [(2,)], 0: [(0, 0)]}  # single- and multi-token breakers
    for allowed in (0, 1, 2, 3):
        got = penalties_of(hist, 0.5, 1.5, allowed, breakers)
        assert got == pytest.approx(dry_ref(hist, 0.5, 1.5, allowed, breakers), rel=1e-6), allowed


def test_a_recent_breaker_limits_the_repeat_and_a_breaker_is_never_penalised() -> None:
    a, b, c, nl = 1, 2, 3, 9
    hist = [a, b, c, nl, a, b, c, nl, a, b]
    assert penalties_of(hist) == pytest.approx({c: 0.8 * 1.75**4})  # "a b c nl a b" then c: 6 tokens
    assert penalties_of(hist, breakers={nl: [()]}) == pytest.approx({c: 0.8})  # run cut at the last \n
    assert penalties_of(hist, breakers={a: [(b,)]}) == {}  # "a b" just ended: no room for a repeat


def test_window_and_context_size() -> None:
    hist = [5, 6, 7, 1, 2, 3, 4, 5, 6]
    x = torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 1.5, 1.0])

    def pick(last_n: int) -> int:
        s = Sampler(SamplerParams(temp=0.0, dry_multiplier=1.0, dry_penalty_last_n=last_n))
        for t in hist:
            s.accept(t)
        return s.sample(x)

    assert pick(64) == 8  # 7 would repeat "5 6 7": 1.5 - 1.0 * 1.75^0 < 1.0
    assert pick(5) == 7  # the last five tokens hold no repeat
    assert pick(0) == 7  # 0 turns DRY off
    for n_ctx, kept in ((3, 3), (0, 9)):  # -1: the context size; with n_ctx 0 the whole history
        s = Sampler(SamplerParams(dry_multiplier=1.0, dry_penalty_last_n=-1), n_ctx)
        d = next(st for name, st in s._stages if name == "dry")
        assert isinstance(d, Dry) and d.last_n == (n_ctx or None)
        for t in hist:
            s.accept(t)
        assert len(d.history) == kept


def test_exponent_is_clamped_to_keep_the_penalty_finite() -> None:
    hist = [1, 2] * 100  # a 198-token repeat
    got = penalties_of(hist, mult=0.8, base=1.75, allowed=2)
    max_exp = int(np.float32(88.7228391) / np.log(np.float32(1.75)))  # 158
    assert got[1] == pytest.approx(0.8 * 1.75**max_exp, rel=1e-6) and np.isfinite(got[1])


def test_penalty_only_touches_candidates_present() -> None:
    d = Dry(1.0, 2.0, 1, None, {})
    for t in [4, 5, 4]:
        d.accept(t)
    c = Cands(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([5, 9, 4]), True)
    out = d(c)
    assert out.logits.tolist() == [2.0, 2.0, 1.0] and not out.sorted  # 5 extends "4" by one


def test_breakers_from_text_against_a_vocabulary(tiny_gemma_model) -> None:  # type: ignore[no-untyped-def]
    v = tiny_gemma_model.vocab
    pieces = [v.token_to_piece(t, special=True) for t in range(v.n_tokens)]
    table = breaker_table(v, ("\n", "he said"))
    assert table is breaker_table(v, ("\n", "he said"))  # matched once per vocabulary
    newline = {t for t, p in enumerate(pieces) if b"\n" in p}
    assert newline and all(() in table[t] for t in newline)
    said = tuple(v.tokenize(" said", add_special=False, parse_special=False))
    e_said = tuple(v.tokenize("e said", add_special=False, parse_special=False))
    for t, p in enumerate(pieces):
        if p.endswith(b"he"):
            assert said in table[t], p
        if p.endswith(b"h"):
            assert e_said in table[t], p
        if t not in newline and not p.endswith((b"h", b"he", b"he ", b"he s", b"he sa", b"he sai")):
            assert t not in table, p
