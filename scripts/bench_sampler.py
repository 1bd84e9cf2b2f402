"""Per-token sampler time on a 262144-entry logits row (the default model's vocabulary).

Prints, never asserts: `python scripts/bench_sampler.py` for the default chain, greedy, and a
chain with every stage on. Each figure is the best of several runs of many tokens, with the
penalty/DRY histories filled as in a real generation (a 64-token prompt, then each pick).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ubatch.engine.sampling.chain import Sampler, SamplerParams

N_VOCAB = 262144
CHAINS: dict[str, dict] = {
    "default": {},
    "greedy (temp 0)": {"temp": 0.0},
    "default + penalties": {"repeat_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.1},
    "all stages on": {
        "repeat_penalty": 1.1,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "dry_multiplier": 0.8,
        "top_n_sigma": 2.0,
        "typ_p": 0.9,
        "xtc_probability": 0.5,
        "xtc_threshold": 0.1,
        "dynatemp_range": 0.3,
    },
    "all stages on, top_k 0": {
        "top_k": 0,
        "repeat_penalty": 1.1,
        "dry_multiplier": 0.8,
        "top_n_sigma": 2.0,
        "typ_p": 0.9,
        "xtc_probability": 0.5,
        "dynatemp_range": 0.3,
    },
    "mirostat 2": {"mirostat": 2},
}


def per_token_ms(kw: dict, rows: list[torch.Tensor], n: int = 100, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        s = Sampler(SamplerParams(seed=1, **kw))
        for t in range(64):
            s.accept(t % 20)
        s.sample(rows[0])
        t0 = time.perf_counter()
        for i in range(n):
            s.accept(s.sample(rows[i % len(rows)]) % 20)  # a repetitive history, so DRY has work
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    return best


def main() -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rows = [torch.from_numpy((rng.standard_normal(N_VOCAB) * 3).astype(np.float32)) for _ in range(8)]
    for name, kw in CHAINS.items():
        try:
            print(f"{name:24s} {per_token_ms(kw, rows):7.3f} ms/token")
        except TypeError:  # an older SamplerParams without these fields
            print(f"{name:24s}     n/a")


if __name__ == "__main__":
    main()
