"""The batched pass (engine/sampling/batched.py) draws the same tokens as each row's own chain,
for the same seeds, step after step, whatever rows share the pass; and the shared top-k is a
stable sort's first k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ubatch.engine.sampling.batched import Row, sample_rows
from ubatch.engine.sampling.bias import LogitBias
from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.sampling.stages import top_k_rows

N_VOCAB = 20000  # long enough that top-k takes its sampled floor (N_VOCAB / 64 > k)

CHAINS = {
    "default": SamplerParams(seed=1),
    "hot": SamplerParams(seed=2, temp=1.7, top_k=100, top_p=0.99, min_p=0.0),
    "top_k_only": SamplerParams(seed=3, temp=1.0, top_k=5, top_p=1.0, min_p=0.0),
    "min_p_keep": SamplerParams(seed=4, top_k=40, top_p=0.5, min_p=0.3, min_keep=7),
    "penalties": SamplerParams(seed=5, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1),
    "greedy": SamplerParams(seed=6, temp=0.0),
    "greedy_penalties": SamplerParams(seed=7, temp=0.0, repeat_penalty=1.5, repeat_last_n=8),
}


def logits_for(step: int, n_rows: int) -> torch.Tensor:
    g = np.random.default_rng(step)
    x = (g.standard_normal((n_rows, N_VOCAB)) * g.uniform(1, 6)).astype(np.float32)
    if step % 3 == 0:  # coarse values: many equal logits among the best
        x = np.round(x * 2) / 2
    return torch.from_numpy(x)


def bias_for(i: int) -> LogitBias | None:
    if i % 2:  # ignore_eos's -inf and a repeated token's biases adding up
        return LogitBias([(0, float("-inf")), (1, 2.0), (1, 1.5), (7, -3.0)])
    if i % 3 == 2:  # more than are added one by one
        return LogitBias([(t, 0.25 * t) for t in range(0, 200, 9)] + [(9, 1.0)])
    return None


@pytest.mark.parametrize("names", [list(CHAINS), ["default"] * 5, ["greedy", "penalties"], ["min_p_keep"]])
def test_one_pass_draws_what_each_row_draws_alone(names: list[str]) -> None:
    alone = [Sampler(CHAINS[n]) for n in names]
    together = [Sampler(CHAINS[n]) for n in names]
    for s in alone + together:
        assert s.row_chain is not None
        for t in (3, 9, 9, 11):  # a prompt for the penalties
            s.accept(t, generated=False)
    for step in range(25):
        x = logits_for(step, len(names))
        before = x.clone()
        want = []
        for i, s in enumerate(alone):
            bias = bias_for(i)
            if bias is None:
                want.append(s.sample(x[i].clone()))
            else:
                with bias.on(x[i].clone()) as row:
                    want.append(s.sample(row))
        rows = [Row(i, s.row_chain, s.rng, bias_for(i)) for i, s in enumerate(together) if s.row_chain]
        got = sample_rows(x, rows)
        assert got == want, f"step {step}"
        assert torch.equal(x, before)  # biases and penalties put back
        for s, t in zip(alone + together, want + got):
            s.accept(t)


def test_rows_in_any_order_and_with_gaps_draw_the_same() -> None:
    x = logits_for(4, 6)
    a = [Sampler(CHAINS["default"]) for _ in range(2)]
    b = [Sampler(CHAINS["default"]) for _ in range(2)]
    first = sample_rows(x, [Row(i, s.row_chain, s.rng) for i, s in zip((1, 4), a) if s.row_chain])
    second = sample_rows(x, [Row(i, s.row_chain, s.rng) for i, s in zip((4, 1), b[::-1]) if s.row_chain])
    assert first == second[::-1]


@pytest.mark.parametrize(
    "params",
    [
        SamplerParams(dry_multiplier=0.8),
        SamplerParams(typ_p=0.9),
        SamplerParams(xtc_probability=0.5),
        SamplerParams(top_n_sigma=1.0),
        SamplerParams(dynatemp_range=0.5),
        SamplerParams(mirostat=2),
        SamplerParams(top_k=0),
        SamplerParams(samplers=("temperature", "top_k")),
    ],
)
def test_chains_the_pass_cannot_run_stay_with_their_row(params: SamplerParams) -> None:
    assert Sampler(params).row_chain is None


def test_top_k_rows_is_a_stable_sort_by_value() -> None:
    g = np.random.default_rng(0)
    for n, k in [(N_VOCAB, 40), (N_VOCAB, 1), (300, 40), (30, 40)]:
        x = np.round(g.standard_normal((4, n)) * 3).astype(np.float32)  # ties everywhere
        x[1, ::7] = -np.inf
        vals, cols = top_k_rows(x, k)
        want = np.argsort(-x, axis=1, kind="stable")[:, :k]
        assert np.array_equal(cols, want) and np.array_equal(vals, np.take_along_axis(x, want, 1))


@pytest.mark.parametrize("i", [1, 2])  # biases added one by one, and by one numpy call
def test_a_biased_row_is_the_row_plus_its_biases_then_the_row_again(i: int) -> None:
    bias = bias_for(i)
    assert bias is not None
    x = logits_for(0, 1)[0]
    before = x.clone()
    want = x.numpy().copy()
    np.add.at(want, bias.ids, np.array(bias.values, dtype=np.float32))
    with bias.on(x) as row:
        assert np.array_equal(row.numpy(), want)
    assert torch.equal(x, before)


def test_greedy_rows_with_lowering_biases_take_the_biased_rows_argmax() -> None:
    """ignore_eos's kind of biases (only lowering) on greedy rows: the plain argmax is kept when
    it is not a biased token, else the biased row's; the same token as the row's own chain,
    including when the best logit is a banned one or ties with one."""
    bias = LogitBias([(5, float("-inf")), (11, -1.0), (5, -2.0)])
    for step in range(12):
        x = logits_for(step, 3)
        if step % 3 == 1:
            x[:, 5] = x.max() + 1  # the banned token is the plain argmax
        if step % 3 == 2:
            x[:, 11] = x[:, 12] = x.max()  # a lowered token ties with the next one
        before = x.clone()
        want = []
        for i in range(3):
            with bias.on(x[i].clone()) as row:
                want.append(Sampler(CHAINS["greedy"]).sample(row))
        s = Sampler(CHAINS["greedy"])
        assert s.row_chain is not None
        got = sample_rows(x, [Row(i, s.row_chain, s.rng, bias) for i in range(3)])
        assert got == want and torch.equal(x, before)
        assert (step % 3 == 0) or got[0] not in (5, 11)
