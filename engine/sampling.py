"""llama.cpp's default sampler chain: penalties -> top_k -> top_p -> min_p -> temperature -> dist.

The random draw reproduces llama.cpp's: a std::mt19937 seeded with the seed (numpy's
RandomState uses the same init_genrand) and std::uniform_real_distribution<double>, which in
libstdc++ combines two 32-bit outputs. Greedy (temp <= 0) takes the first maximum.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import torch

LLAMA_DEFAULT_SEED = 0xFFFFFFFF


@dataclass(slots=True)
class SamplerParams:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    min_keep: int = 0
    seed: int = LLAMA_DEFAULT_SEED  # default / negative = random
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


class Sampler:
    def __init__(self, params: SamplerParams | None = None) -> None:
        self.params = p = params or SamplerParams()
        seed = p.seed
        if seed < 0 or seed == LLAMA_DEFAULT_SEED:
            seed = random.SystemRandom().getrandbits(32)
        self.seed = seed & 0xFFFFFFFF
        self._rng = np.random.RandomState(self.seed)
        self._history: deque[int] = deque(maxlen=max(p.repeat_last_n, 0) or None)

    def accept(self, token: int) -> None:
        """Feed a token into the penalty history (prompt tokens and each sampled one)."""
        if self.params.repeat_last_n != 0:
            self._history.append(token)

    def _uniform(self) -> float:
        a, b = (int(x) for x in self._rng.randint(0, 1 << 32, size=2, dtype=np.uint64))
        u = (a + b * 4294967296.0) / 18446744073709551616.0
        return u if u < 1.0 else np.nextafter(1.0, 0.0)

    def sample(self, logits: torch.Tensor) -> int:
        p = self.params
        x = logits.float()
        if self._history and (p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
            x = x.clone()
            counts = Counter(self._history)
            ids = torch.tensor(list(counts), dtype=torch.long)
            cnt = torch.tensor([counts[i] for i in counts], dtype=torch.float32)
            v = x[ids]
            v = torch.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
            x[ids] = v - cnt * p.frequency_penalty - (cnt > 0).float() * p.presence_penalty
        if p.temp <= 0:
            return int(torch.argmax(x))
        min_keep = max(p.min_keep, 1)
        k = x.numel() if p.top_k <= 0 else min(p.top_k, x.numel())
        vals, ids = torch.topk(x, k)  # sorted descending
        if p.top_p < 1.0:
            probs = torch.softmax(vals, 0)
            cum = torch.cumsum(probs, 0)
            # keep up to and including the first token where the cumulative mass reaches top_p
            n_keep = int(torch.searchsorted(cum, torch.tensor([p.top_p]), right=False)) + 1
            n_keep = max(min(n_keep, vals.numel()), min_keep)
            vals, ids = vals[:n_keep], ids[:n_keep]
        if p.min_p > 0.0:
            keep = vals >= vals[0] + float(np.log(p.min_p))
            n_keep = max(int(keep.sum()), min_keep)
            vals, ids = vals[:n_keep], ids[:n_keep]
        vals = vals / p.temp
        probs = torch.softmax(vals.double(), 0)
        cum = torch.cumsum(probs, 0)
        u = self._uniform() * float(cum[-1])
        i = int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64)))
        return int(ids[min(i, ids.numel() - 1)])
