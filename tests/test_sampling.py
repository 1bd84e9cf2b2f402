"""engine/sampling.py against llama.cpp's sampler chain and its std::mt19937 random stream.

The default chain's stages: penalties -> top_k -> top_p -> min_p -> temperature -> dist. Filters
are checked by sampling many times from hand-made logits (filtered tokens must never come up,
kept ones must); tests/test_samplers_chain.py checks the whole chain draw by draw, the
test_samplers_*.py files the other stages.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from ubatch.engine.sampling.chain import LLAMA_DEFAULT_SEED, Sampler, SamplerParams

TWO32 = 4294967296


def sampler(**kw: float) -> Sampler:
    return Sampler(SamplerParams(**kw))


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def draw_counts(s: Sampler, logits: torch.Tensor, n: int) -> Counter[int]:
    return Counter(s.sample(logits) for _ in range(n))


# -- the random stream ----------------------------------------------------------------------------


def test_randomstate_is_std_mt19937() -> None:
    # the C++ standard fixes these: mt19937 with the default seed 5489 gives 3499211612 first and
    # 4123659995 as its 10000th output
    rs = np.random.RandomState(5489)
    out = rs.randint(0, 1 << 32, size=10000, dtype=np.uint64)
    assert int(out[0]) == 3499211612
    assert int(out[9999]) == 4123659995


def test_uniform_is_libstdcxx_generate_canonical() -> None:
    # std::uniform_real_distribution<double>(0, 1) with a 32-bit engine: two outputs a, b,
    # (a + b * 2^32) / 2^64
    s = sampler(seed=5489)
    ref = np.random.RandomState(5489).randint(0, 1 << 32, size=6, dtype=np.uint64).tolist()
    for i in range(3):
        a, b = ref[2 * i], ref[2 * i + 1]
        expect = (a + b * TWO32) / (TWO32 * TWO32)
        assert s.rng.uniform() == expect
    assert ref[:2] == [3499211612, 581869302]


def test_seed_is_kept_and_default_seed_is_random() -> None:
    assert sampler(seed=42).seed == 42
    assert sampler(seed=0).seed == 0
    seeds = {sampler(seed=LLAMA_DEFAULT_SEED).seed for _ in range(4)} | {sampler(seed=-1).seed for _ in range(4)}
    assert all(0 <= x < TWO32 for x in seeds)
    assert len(seeds) > 1  # drawn from the system's entropy, not fixed


# -- greedy ---------------------------------------------------------------------------------------


def test_greedy_takes_first_maximum() -> None:
    x = torch.tensor([1.0, 5.0, -3.0, 5.0, 4.9])
    for temp in (0.0, -1.0):
        assert sampler(temp=temp, seed=1).sample(x) == 1
    rng = np.random.default_rng(0)
    s = sampler(temp=0.0, seed=3)
    for _ in range(50):
        v = torch.from_numpy(rng.standard_normal(300).astype(np.float32))
        assert s.sample(v) == int(np.argmax(v.numpy()))


def test_greedy_does_not_depend_on_seed_or_filters() -> None:
    x = torch.tensor([0.3, 2.0, 1.9, -1.0])
    picks = {
        sampler(temp=0.0, seed=sd, top_k=tk, top_p=tp, min_p=mp).sample(x)
        for sd in (1, 2, 3)
        for tk in (0, 1, 40)
        for tp in (0.1, 1.0)
        for mp in (0.0, 0.9)
    }
    assert picks == {1}


def test_top_k_1_is_argmax_at_any_temperature() -> None:
    rng = np.random.default_rng(1)
    for temp in (0.5, 1.0, 5.0, 100.0):
        s = sampler(temp=temp, top_k=1, top_p=1.0, min_p=0.0, seed=7)
        for _ in range(20):
            v = torch.from_numpy(rng.standard_normal(500).astype(np.float32))
            assert s.sample(v) == int(np.argmax(v.numpy()))


# -- seeds ----------------------------------------------------------------------------------------

FLAT = torch.zeros(64)  # 64 equally likely tokens


def test_same_seed_same_sequence_different_seed_differs() -> None:
    kw = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = [sampler(seed=42, **kw).sample(FLAT)]
    s1, s2, s3 = sampler(seed=42, **kw), sampler(seed=42, **kw), sampler(seed=43, **kw)
    seq1 = [s1.sample(FLAT) for _ in range(100)]
    seq2 = [s2.sample(FLAT) for _ in range(100)]
    seq3 = [s3.sample(FLAT) for _ in range(100)]
    assert seq1 == seq2
    assert seq1[:1] == a
    assert sum(x != y for x, y in zip(seq1, seq3)) > 80  # independent streams: ~98 % differ
    assert len(set(seq1)) > 30  # really random over the 64 tokens


def test_flat_distribution_is_uniform() -> None:
    c = draw_counts(sampler(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5), torch.zeros(4), 4000)
    assert set(c) == {0, 1, 2, 3}
    assert all(abs(n - 1000) < 120 for n in c.values()), c


@pytest.mark.parametrize("top_k, order", [(0, [0, 1, 2, 3]), (4, [3, 2, 1, 0])])
def test_draw_uses_cumulative_probabilities_in_candidate_order(top_k: int, order: list[int]) -> None:
    # with probabilities p the token whose cumulative interval holds u is chosen (u from the
    # seeded stream): llama.cpp's dist sampler. The candidates keep their order: token-id order
    # when no stage sorted them (top_k 0, top_p 1: as llama.cpp, checked against llama-server),
    # by logit once top_k has sorted them
    probs = [0.1, 0.2, 0.3, 0.4]
    x = logits_of(probs)
    s = sampler(temp=1.0, top_k=top_k, top_p=1.0, min_p=0.0, seed=11)
    ref = np.random.RandomState(11).randint(0, 1 << 32, size=400, dtype=np.uint64).tolist()
    cum = np.cumsum([probs[i] for i in order])
    for i in range(200):
        u = (ref[2 * i] + ref[2 * i + 1] * TWO32) / (TWO32 * TWO32)
        assert s.sample(x) == order[int(np.searchsorted(cum, u))]


def test_temperature_scales_logits() -> None:
    x = torch.tensor([0.0, math.log(2.0)])  # p = 1/3, 2/3 at temp 1
    for temp, p1 in ((1.0, 2 / 3), (2.0, math.sqrt(2) / (1 + math.sqrt(2))), (0.25, 16 / 17)):
        c = draw_counts(sampler(temp=temp, top_k=0, top_p=1.0, min_p=0.0, seed=9), x, 4000)
        assert abs(c[1] / 4000 - p1) < 0.03, (temp, c)


# -- filters --------------------------------------------------------------------------------------

P5 = [0.40, 0.30, 0.20, 0.06, 0.04]


@pytest.mark.parametrize("top_k, kept", [(1, {0}), (2, {0, 1}), (4, {0, 1, 2, 3}), (0, {0, 1, 2, 3, 4})])
def test_top_k_keeps_k_best(top_k: int, kept: set[int]) -> None:
    perm = [2, 4, 0, 3, 1]  # token ids are not in logit order
    x = torch.empty(5)
    x[perm] = logits_of(P5)
    c = draw_counts(sampler(temp=1.0, top_k=top_k, top_p=1.0, min_p=0.0, seed=1), x, 3000)
    assert set(c) == {perm[i] for i in kept}


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.05, {0}),
        (0.35, {0}),
        (0.65, {0, 1}),  # cumulative 0.4, 0.7: the token that reaches p is kept, nothing after it
        (0.85, {0, 1, 2}),
        (0.95, {0, 1, 2, 3}),
        (0.99, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, kept: set[int]) -> None:
    c = draw_counts(sampler(temp=1.0, top_k=0, top_p=top_p, min_p=0.0, seed=2), logits_of(P5), 3000)
    assert set(c) == kept, c


def test_top_p_renormalises_over_kept() -> None:
    c = draw_counts(sampler(temp=1.0, top_k=0, top_p=0.65, min_p=0.0, seed=3), logits_of(P5), 6000)
    assert abs(c[0] / 6000 - 0.4 / 0.7) < 0.03


@pytest.mark.parametrize(
    "min_p, kept",
    [
        (0.05, {0, 1, 2, 3, 4}),  # threshold 0.020
        (0.12, {0, 1, 2, 3}),  # threshold 0.048: 0.06 stays, 0.04 goes
        (0.20, {0, 1, 2}),  # threshold 0.080
        (0.60, {0, 1}),  # threshold 0.240
        (0.90, {0}),  # threshold 0.360
    ],
)
def test_min_p_keeps_tokens_above_fraction_of_max(min_p: float, kept: set[int]) -> None:
    c = draw_counts(sampler(temp=1.0, top_k=0, top_p=1.0, min_p=min_p, seed=4), logits_of(P5), 3000)
    assert set(c) == kept, c


def test_filters_apply_before_temperature() -> None:
    # a high temperature flattens the kept tokens but cannot bring back filtered ones
    c = draw_counts(sampler(temp=50.0, top_k=0, top_p=1.0, min_p=0.12, seed=5), logits_of(P5), 3000)
    assert set(c) == {0, 1, 2, 3}
    assert min(c.values()) > 600  # nearly uniform over the four
    c = draw_counts(sampler(temp=50.0, top_k=0, top_p=0.65, min_p=0.0, seed=5), logits_of(P5), 3000)
    assert set(c) == {0, 1}


# -- penalties ------------------------------------------------------------------------------------


def greedy(**kw: float) -> Sampler:
    return sampler(temp=0.0, **kw)


def test_repeat_penalty_divides_positive_logits() -> None:
    x = torch.tensor([2.0, 1.9, -3.0])
    s = greedy(repeat_penalty=1.1)
    assert s.sample(x) == 0  # nothing seen yet
    s.accept(0)
    assert s.sample(x) == 1  # 2.0 / 1.1 = 1.82 < 1.9
    assert greedy(repeat_penalty=1.04).sample(x) == 0
    s = greedy(repeat_penalty=1.04)
    s.accept(0)
    assert s.sample(x) == 0  # 2.0 / 1.04 = 1.92 > 1.9


def test_repeat_penalty_multiplies_non_positive_logits() -> None:
    x = torch.tensor([-1.0, -1.05, -5.0])
    s = greedy(repeat_penalty=1.1)
    s.accept(0)
    assert s.sample(x) == 1  # -1.0 * 1.1 = -1.1 < -1.05 (dividing would give -0.91 and keep 0)
    x = torch.tensor([0.0, -0.01])
    s = greedy(repeat_penalty=1.5)
    s.accept(0)
    assert s.sample(x) == 0  # 0 * 1.5 = 0 stays the best


def test_repeat_penalty_counts_once_and_leaves_logits_untouched() -> None:
    x = torch.tensor([2.0, 1.9])
    s = greedy(repeat_penalty=1.04)
    for _ in range(5):
        s.accept(0)
    assert s.sample(x) == 0  # not 1.04^5: the repeat penalty ignores counts
    assert x.tolist() == pytest.approx([2.0, 1.9])


def test_repeat_last_n_window() -> None:
    x = torch.tensor([2.0, 1.9, -9.0, -9.0, -9.0])
    s = greedy(repeat_penalty=1.1, repeat_last_n=2)
    s.accept(0)
    s.accept(3)
    assert s.sample(x) == 1  # 0 is within the last 2
    s.accept(4)
    assert s.sample(x) == 0  # 0 has left the window
    s = greedy(repeat_penalty=1.1, repeat_last_n=0)  # 0 disables the penalties
    s.accept(0)
    assert s.sample(x) == 0
    s = greedy(repeat_penalty=1.1, repeat_last_n=-1)  # -1: the whole history
    s.accept(0)
    for _ in range(500):
        s.accept(4)
    assert s.sample(x) == 1


def test_frequency_and_presence_penalties() -> None:
    x = torch.tensor([1.0, 0.5])
    s = greedy(frequency_penalty=0.3)
    s.accept(0)
    assert s.sample(x) == 0  # 1.0 - 0.3 = 0.7
    s.accept(0)
    assert s.sample(x) == 1  # 1.0 - 0.6 = 0.4
    s = greedy(presence_penalty=0.6)
    s.accept(0)
    assert s.sample(x) == 1  # 1.0 - 0.6
    s = greedy(presence_penalty=0.4)
    for _ in range(3):
        s.accept(0)
    assert s.sample(x) == 0  # presence counts once: 0.6 > 0.5
