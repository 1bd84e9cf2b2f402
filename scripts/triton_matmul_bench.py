"""Measure the Triton quantised matmul on a GPU, to tune its block sizes where it runs.

For each type and row count: time `linear` on a weight of random valid blocks (default shape
4096 x 4096, a 7B model's attention projection), check it against dequantise-then-matmul on the
device, and print achieved GB/s (weight + x + out bytes per call; decode is memory-bound, the
H200 roof is ~4.8 TB/s) and TFLOP/s (2 m n k per call; prefill). `--sweep` times other block
sizes of the kernel each row count uses. `--dry-run` runs tiny shapes in Triton's interpreter
(no GPU needed; tests/test_triton_matmul.py does this), so the script is known to work before
a device is lent.

    python scripts/triton_matmul_bench.py [--types Q4_K,Q6_K] [--rows 1,8,16,512] [--shape 4096x4096] [--sweep]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gpu_synth import F16_AT  # the f16 fields of each block type (a sibling script)

from ubatch.kernels.cuda.triton import mode

INTERPRETED = mode.use_interpreter_without_gpu()

from ubatch.kernels.cuda.triton import matmul as mm  # noqa: E402
from ubatch.kernels.quant.dequant import dequantize, type_name  # noqa: E402
from ubatch.kernels.quant.weight import QWeight  # noqa: E402

FLOATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
GEMV1_SWEEP = [(8, 512, 4), (8, 256, 4), (16, 256, 4), (4, 1024, 4), (16, 512, 8)]
GEMV16_SWEEP = [(64, 32, 4), (32, 64, 4), (32, 32, 4), (64, 64, 8)]
TILED_SWEEP = [(128, 64, 32, 8), (64, 64, 32, 4), (128, 128, 32, 8), (64, 128, 32, 4)]


def random_weight(t: int, n: int, k: int, device: str = "cpu", seed: int = 0) -> QWeight:
    """n x k weight of ggml type t: random valid blocks (f16 fields in +-0.05) or random floats."""
    g = torch.Generator().manual_seed(seed + int(t))
    if t in FLOATS:
        raw = torch.randn(n, k, generator=g).to(FLOATS[T(t)]).view(torch.uint8)
    else:
        block, type_size = GGML_QUANT_SIZES[T(t)]
        raw = torch.randint(0, 256, (n * k // block, type_size), dtype=torch.uint8, generator=g)
        for off in F16_AT[T(t)]:  # f16 fields kept finite and small (random bytes would be NaN/Inf)
            f16 = (torch.rand(len(raw), 1, generator=g) * 0.1 - 0.05).half()
            raw[:, off : off + 2] = f16.view(torch.uint8)
        if t == T.MXFP4:  # E8M0 scales 2^-10 .. 2^-1 (random bytes reach 2^127)
            raw[:, 0] = torch.randint(118, 128, (len(raw),), dtype=torch.uint8, generator=g)
        if t == T.IQ1_M:  # its scale's top exponent bit clear: finite
            raw[:, 55] &= 0xBF
    return QWeight(f"w.{type_name(t)}", raw.reshape(-1).to(device), int(t), (n, k))


@contextmanager
def config(m: int, cfg: tuple[int, ...] | None) -> Iterator[None]:
    """Run `linear` with block sizes `cfg` for the kernel m rows use (None: the defaults)."""
    if cfg is None:
        yield
        return
    gemv, tiled = dict(mm.GEMV_CONFIGS), mm.TILED_CONFIG
    if m <= mm.GEMV_MAX_ROWS:
        mm.GEMV_CONFIGS[mm.gemv_rows(m)] = cfg  # type: ignore[assignment]
    else:
        mm.TILED_CONFIG = cfg  # type: ignore[assignment]
    try:
        yield
    finally:
        mm.GEMV_CONFIGS.clear()
        mm.GEMV_CONFIGS.update(gemv)
        mm.TILED_CONFIG = tiled


def time_call(fn: object, iters: int, device: str) -> float:
    """Seconds per call after a warm-up (compiles); CUDA events on the GPU, no sync inside."""
    if device == "cuda":
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()  # type: ignore[operator]
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - t0) / iters


def bench_one(t: int, m: int, n: int, k: int, cfg: tuple[int, ...] | None, iters: int, device: str) -> str:
    w = random_weight(t, n, k, device)
    x = torch.randn(m, k, device=device)
    out = torch.empty(m, n, device=device)
    with config(m, cfg):
        secs = time_call(lambda: mm.linear(x, w, out), iters, device)
    ref = x.double() @ dequantize(w.raw, w.ggml_type, w.shape).double().T
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    nbytes = w.nbytes + x.numel() * 4 + out.numel() * 4
    shown = "default" if cfg is None else "x".join(map(str, cfg))
    return (
        f"{type_name(t):<5} m={m:<4} {n}x{k:<6} {shown:<14} {secs * 1e6:10.1f} us "
        f"{nbytes / secs / 1e9:8.1f} GB/s {2 * m * n * k / secs / 1e12:7.2f} TFLOP/s  err {err:.1e}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K,F16,BF16,F32")
    ap.add_argument("--rows", default="1,2,8,16,512")
    ap.add_argument("--shape", default="4096x4096", help="weight rows x columns (columns: a multiple of 256)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time the other block sizes of each kernel")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, 1 iteration (the interpreter without a GPU)")
    args = ap.parse_args(argv)
    device = "cpu" if INTERPRETED else "cuda"
    n, k = (int(v) for v in args.shape.split("x"))
    rows = [int(v) for v in args.rows.split(",")]
    if args.dry_run:
        n, k, rows, iters = 24, 256, [1, 3, 20], 1
    else:
        iters = args.iters
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}")
    for name in args.types.split(","):
        t = int(T[name])
        for m in rows:
            sweep = GEMV1_SWEEP if m == 1 else GEMV16_SWEEP if m <= mm.GEMV_MAX_ROWS else TILED_SWEEP
            for cfg in [None, *(sweep if args.sweep else [])]:
                print(bench_one(t, m, n, k, cfg, iters, device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
