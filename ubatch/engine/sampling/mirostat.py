"""Mirostat v1 and v2: the last stage of the chain when --mirostat is 1 or 2.

Both keep a running target `mu` (starting at 2 * tau) and, after each draw, move it by
eta * (observed surprise - tau), so the text's surprise (-log2 p of the chosen token) tracks
tau. v1 estimates the Zipf exponent of the 100 best tokens and keeps the top k that exponent
says fit mu; v2 keeps the sorted tokens whose surprise is at most mu. As in llama.cpp, the
draw is std::discrete_distribution over float32 probabilities, and all arithmetic is float32.
"""

from __future__ import annotations

import numpy as np
import torch

from ubatch.engine.sampling.rng import Mt19937
from ubatch.engine.sampling.stages import Cands, probs_f32, top_k

M = 100  # v1: tokens used to estimate the exponent
INT_MIN = -(2**31)


def c_int(v: np.float32) -> int:
    """A float to int32 as the x86 conversion does: NaN or out of range gives INT_MIN."""
    if not np.isfinite(v) or not -(2.0**31) <= float(v) < 2.0**31:
        return INT_MIN
    return int(v)


class Mirostat:
    def __init__(self, version: int, tau: float, eta: float, rng: Mt19937) -> None:
        self.version, self.rng = version, rng
        self.tau, self.eta = np.float32(tau), np.float32(eta)
        self.mu = np.float32(2) * self.tau

    def _v1_k(self, p: np.ndarray, n_vocab: int) -> int:
        kk = min(M - 1, p.size - 1)
        i = np.arange(kk, dtype=np.float32)
        t = np.log((i + 2) / (i + 1))
        b = np.log(p[:kk] / p[1 : kk + 1])
        sum_tb = np.cumsum(t * b, dtype=np.float32)[-1] if kk else np.float32(0)
        sum_tt = np.cumsum(t * t, dtype=np.float32)[-1] if kk else np.float32(0)
        s_hat = sum_tb / sum_tt
        eps = s_hat - np.float32(1)
        one = np.float32(1)
        k = np.power(
            (eps * np.power(np.float32(2), self.mu)) / (one - np.power(np.float32(n_vocab), -eps)), one / s_hat
        )
        return max(c_int(k), 1)

    def __call__(self, c: Cands) -> int:
        """llama.cpp sorts every candidate; only the best n are needed, so only they are."""
        n_vocab = c.size
        with np.errstate(all="ignore"):
            probs = probs_f32(c.logits)
            if self.version == 1:
                best = top_k(Cands(probs, c.ids), M)
                n = self._v1_k(best.logits.numpy(), n_vocab)
            else:  # the surprise grows along the sorted tokens: count those within mu
                n = max(int((-torch.log2(probs) <= float(self.mu)).sum()), 1)
            c = top_k(c, n)
            p = probs_f32(c.logits).numpy()
            idx = self.rng.discrete(p)
            surprise = -np.log2(p[idx])
            self.mu = self.mu - self.eta * (surprise - self.tau)
        return c.token(idx)
