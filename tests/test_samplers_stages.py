"""Each stage of the sampler chain (engine/samplers.py) against hand-computed or independently
computed expectations on small logits vectors, and the chain's order mattering where it must.

The references here are written from llama.cpp's definitions (src/llama-sampler.cpp) in plain
float64 numpy; boundaries are chosen far from float32 rounding.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from ubatch.engine.sampling import stages as S
from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.sampling.rng import Mt19937

P5 = [0.40, 0.30, 0.20, 0.06, 0.04]
OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # every default filter off


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def drawn(n: int = 600, logits: torch.Tensor | None = None, **kw: object) -> Counter[int]:
    s = Sampler(SamplerParams(seed=5, **kw))  # type: ignore[arg-type]
    x = logits_of(P5) if logits is None else logits
    return Counter(s.sample(x) for _ in range(n))


def ids_of(c: S.Cands) -> list[int]:
    return [c.token(i) for i in range(c.size)]


# -- typical --------------------------------------------------------------------------------------


def typical_ref(probs: list[float], p: float, min_keep: int = 0) -> list[int]:
    """Tokens ordered by |surprise - entropy|, until their mass passes p."""
    pr = np.array(probs) / sum(probs)
    h = -np.sum(pr * np.log(pr))
    order = sorted(range(len(pr)), key=lambda i: abs(-math.log(pr[i]) - h))
    cum, out = 0.0, []
    for i, tok in enumerate(order):
        cum += pr[tok]
        out.append(tok)
        if cum > p and (min_keep == 0 or i >= min_keep - 1):
            break
    return out


@pytest.mark.parametrize("p, min_keep", [(0.2, 0), (0.5, 0), (0.5, 3), (0.8, 0), (0.95, 0)])
def test_typical_keeps_tokens_closest_to_the_entropy(p: float, min_keep: int) -> None:
    got = S.typical(S.Cands(logits_of(P5)), p, min_keep)
    assert ids_of(got) == typical_ref(P5, p, min_keep)
    assert not got.sorted  # in distance order, not logit order


def test_typical_can_drop_the_most_likely_token() -> None:
    # H = 1.35 nats; surprises 0.92, 1.20, 1.61, 2.81, 3.22: the second token is the most typical
    assert ids_of(S.typical(S.Cands(logits_of(P5)), 0.2, 0)) == [1]
    assert set(drawn(typ_p=0.2, **OFF)) == {1}


def test_typical_on_a_large_vocabulary_matches_a_full_sort() -> None:
    rng = np.random.default_rng(3)
    x = torch.from_numpy((rng.standard_normal(5000) * 2).astype(np.float32))
    probs = torch.softmax(x.double(), 0).tolist()
    for p in (0.3, 0.9, 0.999):
        assert ids_of(S.typical(S.Cands(x), p, 0)) == typical_ref(probs, p)


# -- top-n-sigma ----------------------------------------------------------------------------------


def test_top_n_sigma_masks_below_max_minus_n_std() -> None:
    x = torch.tensor([10.0, 9.0, 8.5, 6.0, 1.0, 0.0, -2.0, float("-inf")])
    fin = x[torch.isfinite(x)].double().numpy()
    mean, std = fin.mean(), fin.std()  # population std over the finite logits
    for n in (0.5, 1.0, 2.0):
        got = S.top_n_sigma(S.Cands(x), n)
        kept = [i for i, v in enumerate(got.logits.tolist()) if v != float("-inf")]
        assert kept == [i for i, v in enumerate(fin) if v >= 10.0 - n * std], (n, mean, std)
        assert got.size == x.numel()  # masked, not removed
    kept = {i for i, v in enumerate(fin) if v >= 10.0 - 1.0 * std}
    assert set(drawn(logits=x, top_n_sigma=1.0, temp=1.0, **OFF)) == kept == {0, 1, 2, 3}


# -- XTC ------------------------------------------------------------------------------------------


def test_xtc_at_probability_1_drops_all_top_choices_but_the_last() -> None:
    # P5 at threshold 0.1: 0.40, 0.30, 0.20 are above; all but the least of them go
    assert set(drawn(xtc_probability=1.0, xtc_threshold=0.1, **OFF)) == {2, 3, 4}
    assert set(drawn(xtc_probability=1.0, xtc_threshold=0.35, **OFF)) == {0, 1, 2, 3, 4}  # only one above
    assert set(drawn(xtc_probability=1.0, xtc_threshold=0.1, min_keep=4, **OFF)) == {0, 1, 2, 3, 4}


def test_xtc_at_probability_0_or_threshold_above_half_is_off() -> None:
    assert set(drawn(xtc_probability=0.0, xtc_threshold=0.1, **OFF)) == {0, 1, 2, 3, 4}
    assert set(drawn(xtc_probability=1.0, xtc_threshold=0.51, **OFF)) == {0, 1, 2, 3, 4}


def test_xtc_coin_is_its_own_float_stream_from_the_seed() -> None:
    # two tokens above the threshold; a near-zero temperature after XTC makes the pick tell
    # whether XTC fired (token 1) or not (token 0); the coin is a uniform float per step
    s = Sampler(SamplerParams(seed=99, temp=0.001, xtc_probability=0.5, xtc_threshold=0.3, **OFF))
    x = logits_of([0.55, 0.45])
    outs = np.random.RandomState(99).randint(0, 1 << 32, size=200, dtype=np.uint64)
    chances = [float(np.float32(a) / np.float32(2**32)) for a in outs]
    assert [s.sample(x) for _ in range(200)] == [int(c <= 0.5) for c in chances]


def test_xtc_before_a_zero_temperature_changes_the_greedy_pick() -> None:
    # llama.cpp has no separate greedy mode: temperature 0 keeps the best of what XTC left
    assert set(drawn(temp=0.0, xtc_probability=1.0, xtc_threshold=0.1, **OFF)) == {2}
    assert set(drawn(temp=0.0, **OFF)) == {0}


# -- the filters' candidate order and partial sorts ------------------------------------------------


def test_min_p_on_unsorted_candidates_keeps_token_order() -> None:
    x = logits_of([0.04, 0.40, 0.06, 0.30, 0.20])
    got = S.min_p(S.Cands(x), 0.12, 0)
    assert ids_of(got) == [1, 2, 3, 4] and not got.sorted  # 0.048 threshold: token 0 goes


def test_top_p_partial_sort_equals_a_full_sort() -> None:
    rng = np.random.default_rng(7)
    for scale in (4.0, 0.05):  # peaked (the best 256 suffice) and flat (they do not)
        x = torch.from_numpy((rng.standard_normal(3000) * scale).astype(np.float32))
        for p in (0.5, 0.95):
            fast = S.top_p(S.Cands(x), p, 0)
            full = S.top_p(S.Cands(x).sort(), p, 0)
            assert ids_of(fast) == ids_of(full) and fast.sorted


# -- temperature ----------------------------------------------------------------------------------


def test_dynamic_temperature_follows_the_normalised_entropy() -> None:
    flat = torch.full((4,), 3.0)  # entropy = max entropy: the top of the range, 1 + 0.5
    assert S.temperature(S.Cands(flat), 1.0, 0.5, 1.0).logits.tolist() == pytest.approx([2.0] * 4)
    x = torch.tensor([2.0, 1.0, 0.0])
    pr = torch.softmax(x.double(), 0).numpy()
    norm = float(-(pr * np.log(pr)).sum() / math.log(3))
    for exponent in (1.0, 2.0):
        t = 0.5 + (1.5 - 0.5) * norm**exponent
        got = S.temperature(S.Cands(x), 1.0, 0.5, exponent)
        assert got.logits.tolist() == pytest.approx((x / t).tolist(), rel=1e-5)


def test_zero_temperature_without_a_temperature_stage_samples_at_one() -> None:
    # llama.cpp: greedy comes from the temperature stage; leave it out and temp 0 does nothing
    assert len(drawn(temp=0.0, samplers=("top_k",), **OFF)) == 5


# -- the order of the stages ----------------------------------------------------------------------


def test_temperature_before_top_p_widens_what_top_p_keeps() -> None:
    default = drawn(temp=3.0, top_k=0, top_p=0.65, min_p=0.0)
    first = drawn(temp=3.0, top_k=0, top_p=0.65, min_p=0.0, samplers=("temperature", "top_p"))
    assert set(default) == {0, 1}  # top-p on the untempered probabilities, then flattened
    assert set(first) == {0, 1, 2}  # at temperature 3: 0.27, 0.25, 0.21, ...


def test_top_k_before_penalties_changes_the_greedy_pick() -> None:
    x = torch.tensor([2.0, 1.9, 1.8])

    def pick(samplers: tuple[str, ...]) -> int:
        s = Sampler(SamplerParams(temp=0.0, top_k=1, repeat_penalty=1.5, samplers=samplers))
        s.accept(0)
        return s.sample(x)

    assert pick(("penalties", "top_k", "temperature")) == 1  # 2.0 / 1.5 < 1.9, then the best
    assert pick(("top_k", "penalties", "temperature")) == 0  # only token 0 is left to penalise


def test_greedy_shortcut_equals_running_the_whole_chain() -> None:
    rng = np.random.default_rng(11)
    for kw in (dict(), dict(repeat_penalty=1.3, presence_penalty=0.5), dict(dry_multiplier=0.8, top_n_sigma=1.5)):
        s = Sampler(SamplerParams(temp=0.0, seed=1, **kw))  # type: ignore[arg-type]
        assert s._greedy is not None
        for t in [1, 2, 3, 1, 2, 3, 1, 2]:
            s.accept(t)
        for _ in range(10):
            x = torch.from_numpy(rng.standard_normal(400).astype(np.float32))
            c = S.Cands(x)
            for _, stage in s._stages:
                c = stage(c)
            assert s.sample(x) == s._final(c)


def test_chain_leaves_out_stages_that_are_off() -> None:
    assert [n for n, _ in Sampler(SamplerParams())._stages] == ["top_k", "top_p", "min_p", "temperature"]
    on = SamplerParams(repeat_penalty=1.1, dry_multiplier=0.5, top_n_sigma=1.0, typ_p=0.9, xtc_probability=0.1)
    assert [n for n, _ in Sampler(on)._stages] == list(on.samplers)
    assert [n for n, _ in Sampler(SamplerParams(mirostat=2, typ_p=0.5))._stages] == ["temperature"]


def test_xtc_rng_draw_is_independent_of_dist() -> None:
    # a fixed seed seeds dist and XTC alike, each with its own generator
    s = Sampler(SamplerParams(seed=4, xtc_probability=0.5))
    xtc = next(st for n, st in s._stages if n == "xtc")
    assert isinstance(xtc, S.Xtc) and xtc.rng is not s.rng and xtc.rng.seed == s.rng.seed == 4
    assert Mt19937(4).uniform() == s.rng.uniform()
