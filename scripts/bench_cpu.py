"""Prompt processing (pp) and generation (tg) speed on the CPU, llama-bench style.

    python scripts/bench_cpu.py [-m MODEL] [-p 512] [-n 128] [-t THREADS] [-r 3]

Reports tokens/s (mean ± stddev over -r runs after a warm-up), the achieved weight-read
bandwidth during tg (bytes of the dense f32 weights each token must stream), and the share
of tg time spent in matrix multiplications (torch profiler, one extra run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ubatch.engine.batch import Batch
from ubatch.engine.context import Context
from ubatch.engine.default_model import default_model_path
from ubatch.engine.model import Model
from ubatch.engine.params import ContextParams


def run_pp(ctx: Context, n: int) -> float:
    ctx.memory.clear()
    t0 = time.perf_counter()
    for i in range(0, n, ctx.cparams.n_batch):
        ctx.decode(Batch.from_tokens(list(range(1000 + i, 1000 + min(n, i + ctx.cparams.n_batch))), i))
    return n / (time.perf_counter() - t0)


def run_tg(ctx: Context, n: int) -> float:
    ctx.memory.clear()
    ctx.decode(Batch.from_tokens([2], 0))
    t0 = time.perf_counter()
    for i in range(n):
        ctx.decode(Batch.from_tokens([1000 + i], 1 + i))
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=0)
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("-r", type=int, default=3)
    a = ap.parse_args()
    model = Model.load(a.model or default_model_path())
    ctx = Context(model, ContextParams(n_ctx=a.p + a.n + 256, n_ubatch=a.ub, n_threads=a.t, n_outputs_max=1))
    ctx.warmup()
    run_pp(ctx, min(a.p, 64))
    pp = [run_pp(ctx, a.p) for _ in range(a.r)]
    tg = [run_tg(ctx, a.n) for _ in range(a.r)]
    wbytes = sum(w.dense().numel() * 4 for w in model.matrices())
    print(f"model: {model.path.name}, threads: {ctx.cparams.n_threads}, n_ubatch: {ctx.cparams.n_ubatch}, "
          f"torch {torch.__version__}")
    print("| test | t/s | ")
    print("|---|---|")
    sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
    print(f"| pp{a.p} | {statistics.mean(pp):.1f} ± {sd(pp):.1f} |")
    print(f"| tg{a.n} | {statistics.mean(tg):.1f} ± {sd(tg):.1f} |")
    tgm = statistics.mean(tg)
    print(f"tg reads {wbytes / 2**20:.0f} MiB of f32 weights per token "
          f"(output projection {model.output.dense().numel() * 4 / 2**20:.0f} MiB): "
          f"{wbytes * tgm / 1e9:.1f} GB/s achieved")
    from torch.profiler import profile

    with profile() as prof:
        run_tg(ctx, 16)
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    mm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::mv"))
    print(f"tg time in matrix multiplications: {100 * mm / total:.0f}%")


if __name__ == "__main__":
    main()
