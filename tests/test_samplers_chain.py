"""The default chain (top_k -> top_p -> min_p -> temperature -> dist) draw by draw against a
straightforward re-implementation of llama.cpp's loops (src/llama-sampler.cpp) written here
from scratch, on float32 values and the seeded std::mt19937 stream."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ubatch.engine.sampling.chain import Sampler, SamplerParams

TWO32 = 4294967296


def ref_chain(logits: np.ndarray, p: SamplerParams, stream: list[int]) -> int:
    """llama.cpp's top_k -> top_p -> min_p -> temp -> dist on float32, one step; pops 2 outputs."""
    f32 = np.float32
    cand = sorted(((f32(v), i) for i, v in enumerate(logits)), key=lambda t: -t[0])
    if p.top_k > 0:
        cand = cand[: p.top_k]
    if p.top_p < 1.0:
        mx = cand[0][0]
        e = [f32(math.exp(f32(v - mx))) for v, _ in cand]
        s = f32(0)
        for x in e:
            s = f32(s + x)
        cum = f32(0)
        for i, x in enumerate(e):
            cum = f32(cum + f32(x / s))
            if cum >= f32(p.top_p):
                cand = cand[: i + 1]
                break
    if p.min_p > 0.0:
        thr = f32(cand[0][0] + f32(math.log(p.min_p)))
        n = 1
        while n < len(cand) and cand[n][0] >= thr:
            n += 1
        cand = cand[:n]
    vals = [f32(v / f32(p.temp)) for v, _ in cand]
    mx = vals[0]
    e = [float(f32(math.exp(f32(v - mx)))) for v in vals]
    total = math.fsum(e)
    a, b = stream.pop(0), stream.pop(0)
    target = total * ((a + b * TWO32) / (TWO32 * TWO32))
    run = 0.0
    for i, x in enumerate(e):
        run += x
        if run >= target:
            return cand[i][1]
    return cand[-1][1]


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # llama.cpp's defaults: top_k 40, top_p 0.95, min_p 0.05, temp 0.8
        dict(temp=1.3, top_k=0, top_p=0.9, min_p=0.0),
        dict(temp=0.7, top_k=100, top_p=1.0, min_p=0.02),
    ],
)
def test_chain_matches_llama_cpp_draw_by_draw(kw: dict) -> None:
    rng = np.random.default_rng(2024)
    p = SamplerParams(seed=1234, **kw)
    s = Sampler(p)
    stream = np.random.RandomState(1234).randint(0, 1 << 32, size=2 * 300, dtype=np.uint64).tolist()
    picks = []
    for step in range(300):
        v = (rng.standard_normal(2000) * 2.5).astype(np.float32)
        got = s.sample(torch.from_numpy(v))
        assert got == ref_chain(v, p, stream), f"step {step}"
        picks.append(got)
    assert len(set(picks)) > 20  # the draws are random, not argmax every time
