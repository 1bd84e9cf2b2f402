"""llama.cpp's random draws: std::mt19937 and the three libstdc++ distributions its samplers use.

numpy's RandomState is the same engine with the same init_genrand seeding, so a seed gives
llama.cpp's stream. libstdc++'s generate_canonical takes two 32-bit outputs for a double
(uniform_real_distribution<double>, discrete_distribution) and one for a float
(uniform_real_distribution<float>, XTC's coin).
"""

from __future__ import annotations

import random

import numpy as np

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
TWO32 = 4294967296.0
_ONE_BELOW_F32 = float(np.nextafter(np.float32(1.0), np.float32(0.0)))


def resolve_seed(seed: int) -> int:
    """get_rng_seed: the default seed (or a negative one) means a fresh random seed."""
    if seed < 0 or seed == LLAMA_DEFAULT_SEED:
        return random.SystemRandom().getrandbits(32)
    return seed & 0xFFFFFFFF


class Mt19937:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._rs = np.random.RandomState(seed)

    def uniform(self) -> float:
        """std::uniform_real_distribution<double>(0, 1): (a + b * 2^32) / 2^64, below 1."""
        a, b = self._rs.randint(0, 1 << 32, size=2, dtype=np.uint64).tolist()
        u = (a + b * TWO32) / (TWO32 * TWO32)
        return u if u < 1.0 else float(np.nextafter(1.0, 0.0))

    def uniform_float(self) -> float:
        """std::uniform_real_distribution<float>(0, 1): one output, rounded to float, / 2^32."""
        a = int(self._rs.randint(0, 1 << 32, dtype=np.uint64))
        u = float(np.float32(a) / np.float32(TWO32))
        return u if u < 1.0 else _ONE_BELOW_F32

    def discrete(self, weights: np.ndarray) -> int:
        """std::discrete_distribution<int>: no draw at all for fewer than two weights."""
        if weights.size < 2:
            return 0
        w = weights.astype(np.float64)
        cp = np.cumsum(w / np.cumsum(w)[-1])  # sequential sums, as std::accumulate / partial_sum
        cp[-1] = 1.0
        return int(np.searchsorted(cp, self.uniform(), side="left"))
