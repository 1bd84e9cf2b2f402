"""Units every report shares, defined once so a MiB or a t/s means the same thing everywhere."""

from __future__ import annotations

MiB = 1024 * 1024


def mib(n: int | float) -> float:
    """Bytes as MiB (llama.cpp reports every buffer in MiB)."""
    return n / MiB


def tokens_per_second(n: int, ms: float) -> float:
    """llama.cpp's `1e3 / t_ms * n`, 0 when nothing was timed."""
    return 1e3 * n / ms if ms > 0 else 0.0
