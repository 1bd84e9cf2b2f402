"""Mirostat v1 and v2 (engine/sampler_mirostat.py) draw by draw against a loop-by-loop
re-implementation of llama.cpp's (src/llama-sampler.cpp) written here in float32 scalars, with
libstdc++'s discrete_distribution spelled out; and mu's update checked by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.sampling.mirostat import Mirostat, c_int
from ubatch.engine.sampling.rng import Mt19937

F = np.float32
TWO32 = 4294967296


class Stream:
    """mt19937 outputs, two per double as libstdc++'s generate_canonical."""

    def __init__(self, seed: int) -> None:
        self.out = np.random.RandomState(seed).randint(0, 1 << 32, size=4000, dtype=np.uint64).tolist()

    def double(self) -> float:
        a, b = self.out.pop(0), self.out.pop(0)
        return (a + b * TWO32) / (TWO32 * TWO32)


def softmax(logits: list[np.float32]) -> list[np.float32]:
    mx = max(logits)
    e = [F(math.exp(F(v - mx))) for v in logits]
    total = F(0)
    for x in e:
        total = F(total + x)
    return [F(x / total) for x in e]


def discrete(p: list[np.float32], stream: Stream) -> int:
    if len(p) < 2:
        return 0
    total = 0.0
    for x in p:
        total += float(x)
    cum, cp = 0.0, []
    for x in p:
        cum += float(x) / total
        cp.append(cum)
    cp[-1] = 1.0
    u = stream.double()
    return next(i for i, c in enumerate(cp) if c >= u)


def ref_v1_k(p: list[np.float32], n_vocab: int, mu: np.float32) -> int:
    """v1's k: the Zipf exponent s_hat from the best 100 tokens, then the top k for mu."""
    sum_tb, sum_tt = F(0), F(0)
    for i in range(min(99, len(p) - 1)):
        t = F(math.log(F(i + 2) / F(i + 1)))
        b = F(math.log(F(p[i] / p[i + 1])))
        sum_tb, sum_tt = F(sum_tb + F(t * b)), F(sum_tt + F(t * t))
    s_hat = F(sum_tb / sum_tt)
    eps = F(s_hat - F(1))
    k = F(F(eps * F(2.0**mu)) / F(F(1) - F(float(n_vocab) ** -float(eps)))) ** F(F(1) / s_hat)
    return max(int(k), 1)


def ref_step(version: int, logits: np.ndarray, temp: float, tau: float, eta: float, mu: np.float32, stream: Stream):
    cand = sorted(((F(F(v) / F(temp)), i) for i, v in enumerate(logits)), key=lambda t: -t[0])
    p = softmax([v for v, _ in cand])
    if version == 1:
        n = ref_v1_k(p, len(logits), mu)
    else:
        n = next((i for i, x in enumerate(p) if -math.log2(x) > mu), len(p))
        n = max(n, 1)
    cand = cand[:n]
    p = softmax([v for v, _ in cand])
    idx = discrete(p, stream)
    mu = F(mu - F(F(eta) * F(F(-math.log2(p[idx])) - F(tau))))
    return cand[idx][1], mu


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("temp, tau", [(1.0, 5.0), (0.7, 3.0)])
def test_mirostat_matches_llama_cpp_draw_by_draw(version: int, temp: float, tau: float) -> None:
    rng = np.random.default_rng(version * 10 + int(tau))
    s = Sampler(SamplerParams(seed=321, mirostat=version, mirostat_tau=tau, mirostat_eta=0.1, temp=temp))
    stream, mu, picks = Stream(321), F(2 * tau), []
    for step in range(40):
        v = (rng.standard_normal(600) * 2.5).astype(np.float32)
        want, mu = ref_step(version, v, temp, tau, 0.1, mu, stream)
        assert s.sample(torch.from_numpy(v)) == want, f"step {step}"
        assert s._final.mu == pytest.approx(float(mu), rel=1e-5)  # type: ignore[attr-defined]
        picks.append(want)
    assert len(set(picks)) > 5


def test_v1_top_k_from_the_estimated_exponent() -> None:
    rng = np.random.default_rng(5)
    ks = []
    for zipf in (0.8, 1.1, 1.5, 2.5):
        ranks = np.arange(1, 3001, dtype=np.float64)
        p = ranks**-zipf * np.exp(rng.standard_normal(3000) * 0.05)
        p = [F(x) for x in sorted(p / p.sum(), reverse=True)]
        for mu in (F(4.0), F(8.0), F(10.0)):
            m = Mirostat(1, 5.0, 0.1, Mt19937(1))
            m.mu = mu
            ks.append(m._v1_k(np.array(p, dtype=np.float32), 3000))
            assert ks[-1] == ref_v1_k(p, 3000, mu), (zipf, mu)
    assert len(set(ks)) > 6  # the exponent and mu both move k


def test_mu_moves_by_eta_times_the_surprise_error() -> None:
    # v2, two equally likely tokens: the first mu (2 * tau = 2) keeps both (surprise 1 bit each);
    # the pick has surprise 1, so mu = 2 - 0.5 * (1 - 1) = 2; with tau 3, mu = 6 - 0.5 * (1 - 3) = 7
    for tau, after in ((1.0, 2.0), (3.0, 7.0)):
        s = Sampler(SamplerParams(seed=1, mirostat=2, mirostat_tau=tau, mirostat_eta=0.5, temp=1.0))
        s.sample(torch.zeros(2))
        assert s._final.mu == pytest.approx(after)  # type: ignore[attr-defined]
    # one dominant token (surprise 0): mu rises by eta * tau each step
    s = Sampler(SamplerParams(seed=1, mirostat=2, mirostat_tau=1.0, mirostat_eta=0.5, temp=1.0))
    for step in range(3):
        assert s.sample(torch.tensor([0.0, -40.0, -40.0])) == 0
        assert s._final.mu == pytest.approx(2.0 + 0.5 * (step + 1), abs=1e-5)  # type: ignore[attr-defined]


def test_v2_truncates_tokens_more_surprising_than_mu() -> None:
    # mu starts at 2 * tau = 2 bits: only tokens with p >= 1/4 can be drawn
    x = torch.log(torch.tensor([0.3, 0.28, 0.26, 0.16]))
    seen = set()
    for seed in range(60):
        s = Sampler(SamplerParams(seed=seed, mirostat=2, mirostat_tau=1.0, temp=1.0))
        seen.add(s.sample(x))
    assert seen == {0, 1, 2}


def test_float_to_int_conversion_of_k() -> None:
    assert [c_int(F(v)) for v in (3.9, 1.0, -2.5)] == [3, 1, -2]
    assert [c_int(F(v)) for v in (np.nan, np.inf, 3e9)] == [-(2**31)] * 3  # then max(k, 1) = 1
