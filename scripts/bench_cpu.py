"""Prompt processing (pp) and generation (tg) speed on the CPU, llama-bench style.

    python scripts/bench_cpu.py [-m MODEL] [-p 512] [-n 128] [-t THREADS] [-ub 512] [-r 3]

A thin wrapper over `ubatch bench` (engine/bench.py) that adds the tg bandwidth view: tokens/s
(mean ± stddev over -r runs after a warm-up), the weight-read bandwidth tg achieves (bytes of the
dense f32 weights each token must stream), and the share of tg time in matrix multiplications
(from the op profile). For everything else use `ubatch bench` (lists, ranges, -o, --plot).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ubatch.engine.bench import BenchParams, run_bench
from ubatch.engine.default_model import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=0)
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("-r", type=int, default=3)
    a = ap.parse_args()
    path = Path(a.model) if a.model else default_model_path()
    p = BenchParams(models=[path], n_prompt=[a.p], n_gen=[a.n], n_ubatch=[a.ub], n_threads=[a.t],
                    reps=a.r, profile=True)
    results = run_bench(p)
    r0 = results[0]
    print(f"model: {path.name} ({r0.model_type}), threads: {r0.n_threads}, n_ubatch: {a.ub}, torch {torch.__version__}")
    print("| test | t/s | compute buffer MiB |")
    print("|---|---:|---:|")
    for r in results:
        print(f"| {r.test} | {r.avg_ts:.1f} ± {r.stddev_ts:.1f} | {r.compute_buffer_mib:.2f} |")
    tg = next((r for r in results if r.n_gen and not r.n_prompt), None)
    if tg is not None:
        from ubatch.engine.model import Model

        model = Model.load(path)
        wbytes = sum(w.shape[0] * w.shape[1] * 4 for w in model.matrices())
        out_bytes = model.output.shape[0] * model.output.shape[1] * 4
        print(f"tg reads {wbytes / 2**20:.0f} MiB of f32 weights per token (output projection "
              f"{out_bytes / 2**20:.0f} MiB): {wbytes * tg.avg_ts / 1e9:.1f} GB/s achieved")
        total = sum(tg.profile_ms.values()) or 1.0
        mm = tg.profile_ms.get("matmul", 0.0) + tg.profile_ms.get("lm_head", 0.0)
        print(f"tg time in matrix multiplications: {100 * mm / total:.0f}% "
              f"(output projection alone {100 * tg.profile_ms.get('lm_head', 0.0) / total:.0f}%)")


if __name__ == "__main__":
    main()
