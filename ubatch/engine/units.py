"""Units every report shares, defined once so a MiB or a t/s means the same thing everywhere."""

from __future__ import annotations

MiB = 1024 * 1024


def mib(n: int | float) -> float:
    """Bytes as MiB (llama.cpp reports every buffer in MiB)."""
    return n / MiB


def tokens_per_second(n: int, ms: float) -> float:
    """llama.cpp's `1e3 / t_ms * n`, 0 when nothing was timed."""
    return 1e3 * n / ms if ms > 0 else 0.0


class DecodeRates:
    """prompt_tps / eval_tps for any stats with n_prompt, t_prompt_ms, n_eval and t_eval_ms."""

    __slots__ = ()
    n_prompt: int
    t_prompt_ms: float
    n_eval: int
    t_eval_ms: float

    @property
    def prompt_tps(self) -> float:
        return tokens_per_second(self.n_prompt, self.t_prompt_ms)

    @property
    def eval_tps(self) -> float:
        return tokens_per_second(self.n_eval, self.t_eval_ms)
