"""This machine's peaks, measured now, so that a profile can say what fraction of them an op reaches.

`bench --profile` divides each matmul category's work by its time: flop/s against the f32 FMA
peak and the integer dot-product peaks (the kernels' integer paths), bytes of weights read per
second against a plain streaming read. The probes are csrc/peaks.c, built with the kernels, so
they use the same instructions the kernels can use on this CPU (zmm or ymm, VNNI or not).
"""

from __future__ import annotations

from dataclasses import dataclass

from ubatch.kernels.cpu.build import CpuLibrary

READ_BYTES = 512 << 20  # well past any L3 of today's CPUs, so the read probe measures memory
PROBE_SECONDS = 0.15


@dataclass(frozen=True, slots=True)
class MachinePeaks:
    """Rates on `n_threads` threads: flop/s for FMA, ops/s (2 a multiply-add) for the dot products,
    bytes/s for the read; `simd` is the kernel build that measured them."""

    n_threads: int
    simd: str
    fma_flops: float
    dot16_ops: float  # 16-bit pairs: vpdpwssd (VNNI) or vpmaddwd + vpaddd
    dot8_ops: float  # u8 x s8: vpdpbusd (VNNI) or vpmaddubsw + vpmaddwd + vpaddd
    read_bytes: float

    def describe(self) -> str:
        return (
            f"{self.n_threads} threads, {self.simd} build: f32 FMA {self.fma_flops / 1e9:.0f} GFLOP/s, "
            f"int16 dot {self.dot16_ops / 1e9:.0f} GOP/s, int8 dot {self.dot8_ops / 1e9:.0f} GOP/s, "
            f"streaming read {self.read_bytes / 1e9:.1f} GB/s"
        )


_MEASURED: dict[tuple[str, int], MachinePeaks] = {}


def measure_peaks(lib: CpuLibrary, n_threads: int) -> MachinePeaks:
    """The four probes on n_threads threads, about 0.6 s in all; measured once per process and
    thread count (a profile taken under load reads peaks under the same load)."""
    key = (str(lib.path), n_threads)
    if key in _MEASURED:
        return _MEASURED[key]
    f = lib.lib.ub_peak
    _MEASURED[key] = MachinePeaks(
        n_threads,
        lib.simd,
        f(0, n_threads, PROBE_SECONDS, 0),
        f(1, n_threads, PROBE_SECONDS, 0),
        f(2, n_threads, PROBE_SECONDS, 0),
        f(3, n_threads, PROBE_SECONDS, READ_BYTES),
    )
    return _MEASURED[key]


__all__ = ["MachinePeaks", "measure_peaks"]
