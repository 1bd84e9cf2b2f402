"""Which kernel build the default CPU backend runs, chosen by measured speed, not by CPU flags.

An AVX-512 CPU can run two builds of the kernels: the native one (zmm, VNNI) and the AVX2 one
(ymm). The flags do not say which is faster: on Zen 4, which executes a 512-bit operation as two
256-bit halves, the AVX2 build measured faster in prefill and decode (12-04: pp512 847-1026 vs
730-761 t/s, tg128 89-95 vs 69-83); on a Zen 5 (12-06, one thread) it depends on the op: the
AVX-512 build's time over the AVX2 one's is 0.88x for a 1-row GEMV, 1.04x at 4 rows, 1.43x at
16, 0.80x for the GEMM and 1.37x for decode attention. So the first time a thread
count is used on a CPU, both builds time the ops a model spends its time in, on the matrix
shapes of a 1-2B model (2048 x 2048, 6144 x 2048, 2048 x 6144 in Q4_K, Q6_K and Q8_0): the
decode GEMV at 1, 4 and 16 rows, the prefill GEMM (128 rows) and decode attention over 1024 f16
cells. Decode (graphs of up to 16 tokens) and prefill are judged apart: the AVX2 build takes a
phase where it is faster at each of its ops and at least MARGIN faster over all (the geometric
mean of the time ratios), so noise cannot flip the choice and no shape gets slower by it; where
the phases would split, both stay on AVX-512 (the builds round x differently, and a sequence's
prefill and decode must agree). The
probe runs on one thread, once per CPU and pair of builds (about 4 s), so that a neighbour busy
on another core does not decide it; the result holds for every thread count. The decision and every op's ratio are cached beside the kernel builds
(keyed by both builds, so a new build or a new CPU measures again) and shown by `info`, the
startup log and `bench`. `--backend cpu` or `cpu-avx2` still forces a build.

Why by phase and not op by op: a decode step's C calls run as fused programs, each inside one
library (kernels/cpu/program.py), so switching builds between neighbouring ops would split them;
and a GEMV's build must not depend on its row count (see `decide`). The per-op ratios are
measured and reported all the same.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ubatch.kernels.cpu import build
from ubatch.kernels.cpu.bind import GEMV_MAX_ROWS, CpuKernels
from ubatch.kernels.cpu.build import CpuLibrary, cache_dir, load
from ubatch.kernels.ops import AttentionArgs, KVTensor
from ubatch.kernels.quant.weight import QWeight

MARGIN = 0.05  # the AVX2 build must be this much faster over a phase (geometric mean) to take it
SHAPES = ((2048, 2048), (6144, 2048), (2048, 6144))  # (rows, cols) of a 1-2B model's matrices
TYPES = (T.Q4_K, T.Q6_K, T.Q8_0)
GEMM_ROWS = 128
DECODE_OPS = ("gemv1", "gemv4", "gemv16", "attention")
PREFILL_OPS = (f"gemm{GEMM_ROWS}",)
MIN_SECONDS = 0.005  # a turn repeats its call for at least this long; the best per-call time is kept
ROUNDS = 3  # alternating turns of the two builds per op


@dataclass(frozen=True, slots=True)
class BuildChoice:
    """The builds the default backend runs ("avx512" or "avx2"): `decode` for graphs of up to
    GEMV_MAX_ROWS tokens (the GEMV, decode attention and the small ops between them), `prefill`
    for larger ones (the GEMM and its ops); why; and per op the AVX-512 build's time over the
    AVX2 build's (below 1: AVX-512 faster)."""

    decode: str
    prefill: str
    reason: str
    ratios: dict[str, float] = field(default_factory=dict)
    cached: bool = False

    def lines(self) -> tuple[str, ...]:
        """What `info`, the startup log and `bench` say: the choice, then the measured ratios."""
        if not self.ratios:
            return (self.reason,)
        per_op = ", ".join(f"{op} {r:.2f}x" for op, r in self.ratios.items())
        return self.reason, f"measured on this CPU, AVX-512 time / AVX2 time: {per_op}"


def _weight(ggml_type: int, n: int, k: int, rng: np.random.Generator) -> QWeight:
    """A matrix of random codes with sane block scales (random f16 bits would include NaNs and
    subnormals, which can take slow paths that real weights never do)."""
    block, size, scale_at = {T.Q4_K: (256, 144, (0, 2)), T.Q6_K: (256, 210, (208,)), T.Q8_0: (32, 34, (0,))}[
        T(ggml_type)
    ]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    for off in scale_at:
        raw[:, :, off : off + 2] = d
    return QWeight(f"probe{T(ggml_type).name}", torch.from_numpy(raw.reshape(-1).copy()), int(ggml_type), (n, k))


def _seconds(call: Callable[[], object]) -> float:
    """The best time of one call over at least MIN_SECONDS and three runs."""
    best, spent, runs = float("inf"), 0.0, 0
    while spent < MIN_SECONDS or runs < 3:
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return best


def _paired(calls: tuple[Callable[[], object], Callable[[], object]]) -> tuple[float, float]:
    """Both builds' best times of one op, taken in ROUNDS alternating turns: a neighbour's load
    lands on both sides, not on whichever build happened to run while it was busy."""
    for c in calls:
        c()  # warm: caches, the thread pool, lazy repacks
    best = [float("inf"), float("inf")]
    for _ in range(ROUNDS):
        for i, c in enumerate(calls):
            best[i] = min(best[i], _seconds(c))
    return best[0], best[1]


def _linear_call(kn: CpuKernels, w: QWeight, m: int) -> Callable[[], object]:
    x, out = torch.randn(m, w.shape[1]), torch.empty(m, w.shape[0])
    if m <= GEMV_MAX_ROWS:
        need = kn.gemv_scratch(m, w)
    else:
        need = max(kn.gemm_scratch(m, w), kn.amx_scratch(m))
    scratch = torch.empty(max(need, 1))
    call = kn.linear(x, w, out, [scratch])
    if call is None:
        raise OSError(f"no C kernel for {T(w.ggml_type).name} at {m} rows")
    return lambda: (call(), x, out, scratch)  # a bound call keeps only pointers: hold its tensors


def _attention_call(kn: CpuKernels) -> Callable[[], object]:
    """One decode row of a 16-head (8 KV heads) layer over 1024 f16 cells."""
    h, h_kv, d, n_kv = 16, 8, 128, 1024
    g = torch.Generator().manual_seed(0)
    k = KVTensor(torch.randn(n_kv, h_kv, d, generator=g).half(), int(T.F16), h_kv, d)
    v = KVTensor(torch.randn(n_kv, h_kv, d, generator=g).half(), int(T.F16), h_kv, d)
    q, out = torch.randn(1, 1, h, d, generator=g), torch.empty(1, 1, h, d)
    args = AttentionArgs(q, k, v, torch.zeros(1, dtype=torch.int64), n_kv, torch.zeros(1, 1, n_kv).half(), d**-0.5)
    call = kn.attention(args, out)
    if call is None:
        raise OSError("no C kernel for decode attention")
    return lambda: (call(), args, out)


def time_ops(native: CpuKernels, avx2: CpuKernels) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per op of each build, summed over the probe matrices (attention: one call)."""
    rng = np.random.default_rng(0)
    weights = [_weight(t, n, k, rng) for t in TYPES for n, k in SHAPES]
    out: tuple[dict[str, float], dict[str, float]] = ({}, {})
    for m in (1, 4, 16, GEMM_ROWS):
        op = f"gemv{m}" if m <= GEMV_MAX_ROWS else f"gemm{m}"
        # the GEMM on the square matrices only: its speed per flop hardly depends on the shape,
        # and three of them keep the probe under a few seconds
        for w in weights if m <= GEMV_MAX_ROWS else [w for w in weights if w.shape == SHAPES[0]]:
            a, b = _paired((_linear_call(native, w, m), _linear_call(avx2, w, m)))
            out[0][op], out[1][op] = out[0].get(op, 0.0) + a, out[1].get(op, 0.0) + b
    out[0]["attention"], out[1]["attention"] = _paired((_attention_call(native), _attention_call(avx2)))
    return out


def _phase(native: dict[str, float], avx2: dict[str, float], ops: tuple[str, ...]) -> tuple[str, float]:
    """The build for a phase and the geometric mean of its ops' time ratios (native / AVX2). The
    AVX2 build takes a phase only when it is faster at every op of it and at least MARGIN faster
    over all: a phase where each build wins some shapes stays native, so switching never makes
    a shape slower (where the builds split, the ratios say which native kernel lags)."""
    ratios = [native[op] / avx2[op] for op in ops]
    mean = math.prod(ratios) ** (1 / len(ratios))
    return ("avx2" if min(ratios) > 1 and mean > 1 + MARGIN else "avx512"), mean


def _why(phase: str, ops: tuple[str, ...], ratios: dict[str, float], build_: str, mean: float) -> str:
    if build_ == "avx2":
        return f"{phase} on the AVX2 build (faster at each of its ops, {mean:.2f}x over all)"
    faster = [op for op in ops if ratios[op] > 1]
    if not faster:
        return f"{phase} on the AVX-512 build (faster at each of its ops)"
    slower = [op for op in ops if op not in faster]
    if not slower:
        return f"{phase} on the AVX-512 build (the AVX2 one is faster by less than {MARGIN:.0%})"
    return (
        f"{phase} on the AVX-512 build (the AVX2 one is faster at {', '.join(faster)} but not at {', '.join(slower)})"
    )


def decide(native: dict[str, float], avx2: dict[str, float]) -> BuildChoice:
    """The choice from both builds' op times (pure: tests feed it timings). Decode is one choice
    for all its row counts: a row's bits must not depend on how many rows share its GEMV
    (speculative verification relies on it), so GEMVs of 1 and of 16 rows come from one build."""
    ratios = {op: native[op] / avx2[op] for op in native if avx2.get(op)}
    decode, r_dec = _phase(native, avx2, DECODE_OPS)
    prefill, r_pre = _phase(native, avx2, PREFILL_OPS)
    reason = (
        f"{_why('decode', DECODE_OPS, ratios, decode, r_dec)}; {_why('prefill', PREFILL_OPS, ratios, prefill, r_pre)}"
    )
    if decode != prefill:
        # The builds read x differently (AVX2: 16 bits per 32 values; AVX-512: as exactly as f32),
        # so a sequence prefilled on one and decoded on the other would see its logits move by up
        # to ~0.015 between the two (tests/test_isolation.py): both phases take the AVX-512 build.
        reason += "; both on the AVX-512 build, so that prefill and decode read x alike"
        decode = prefill = "avx512"
    return BuildChoice(decode, prefill, reason, ratios)


def _cache_file(native: CpuLibrary, avx2: CpuLibrary) -> Path:
    key = hashlib.sha256(f"{native.path.name}\0{avx2.path.name}".encode()).hexdigest()[:16]
    return cache_dir() / f"dispatch-{key}.json"


def choose_build() -> BuildChoice:
    """The builds the default CPU backend runs; measured once per CPU and pair of builds, then
    read from the cache. Without AVX-512 (or with only one build loadable) there is nothing to
    choose."""
    native = load()
    if native.simd != "avx512":
        return BuildChoice(native.simd, native.simd, f"the {native.simd} build: the only one for this CPU")
    try:
        avx2 = load(no_avx512=True)
    except OSError as e:
        return BuildChoice("avx512", "avx512", f"the AVX-512 build: the AVX2 build could not be had ({e})")
    path = _cache_file(native, avx2)
    try:
        d = json.loads(path.read_text())
        return BuildChoice(d["decode"], d["prefill"], d["reason"], d["ratios"], cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    line = "measuring which kernel build is faster on this CPU, once: ~4 s"
    with build.on_build(line) if build.on_build is not None else nullcontext(), torch.inference_mode():
        choice = decide(*time_ops(CpuKernels(native, 1), CpuKernels(avx2, 1)))
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        d = asdict(choice)
        d.pop("cached")
        tmp.write_text(json.dumps(d))
        tmp.replace(path)  # atomic: a concurrent first start reads a whole file or none
    except OSError:
        pass  # a read-only cache: measure again next time
    return choice


__all__ = ["BuildChoice", "choose_build", "decide", "time_ops", "DECODE_OPS", "MARGIN", "PREFILL_OPS"]
