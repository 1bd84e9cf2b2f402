"""Tensor parallelism on this machine: 1 rank against 2 (or more), in one run.

    python scripts/bench_tp.py [-m MODEL] [--ranks 2] [-t THREADS_PER_RANK] [-r 3] [--npl 1,4,16] [--json FILE]

For each rank count: pp512 and tg128 t/s (best of -r), aggregate decode S_TG at each -npl
(-npp 64 prompts, 32 steps of one token per sequence), and where a decode token's time goes on
rank 0: compute (the backend's ops), all-reduce and gather (the collectives, which include waiting
for the slowest rank) and Python (everything else: batch bookkeeping, the messages to the other
ranks, the graph runner). Memory per rank: the plan's weights, KV cache and compute buffer, and
each rank process's resident set. The CPU model and the threads per rank are printed with the
tables. The ranks are started here (as `ubatch ... -tp N` does); -t is per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context, make_backend
from ubatch.engine.context.report import memory_plan
from ubatch.engine.model.default_model import default_model_path
from ubatch.engine.model.model import Model
from ubatch.engine.parallel.launch import Ranks, start
from ubatch.engine.parallel.worker import load_shard
from ubatch.engine.params import ContextParams
from ubatch.kernels.cpu.build import cpu_model
from ubatch.kernels.profiling import ProfilingOps

MIB = 1 << 20


@dataclass
class Row:
    ranks: int
    pp512: float = 0.0
    tg128: float = 0.0
    s_tg: dict[int, float] = field(default_factory=dict)
    tg_ms: dict[str, float] = field(default_factory=dict)  # one decode token on rank 0: compute / collective / python
    weights_mib: float = 0.0
    kv_mib: float = 0.0
    compute_mib: float = 0.0
    rss_mib: list[float] = field(default_factory=list)  # per rank process


def rss_mib(pid: int | None = None) -> float:
    """Resident set of a process (this one when pid is None), MiB."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def best(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(model: Model, threads: int, reps: int, npl: list[int], backend: str) -> Row:
    rng = np.random.default_rng(0)
    n_vocab = model.hparams.n_vocab
    params = ContextParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_outputs_max=1, n_threads=threads, backend=backend)
    ctx = Context(model, params)
    row = Row(model.shard.world if model.shard is not None else 1)
    plan = memory_plan(ctx)
    row.weights_mib, row.kv_mib, row.compute_mib = plan.model_bytes / MIB, plan.kv_bytes / MIB, plan.compute_bytes / MIB
    prompt = rng.integers(0, n_vocab, 512).tolist()

    def pp(c: Context = ctx) -> None:
        c.memory.clear()
        c.decode(Batch.from_tokens(prompt, 0, 0))

    def tg(c: Context = ctx) -> None:
        c.memory.clear()
        for i in range(128):
            c.decode(Batch.from_tokens([int(prompt[i])], i, 0))

    pp()  # warm up
    row.pp512 = 512 / best(pp, reps)
    row.tg128 = 128 / best(tg, reps)
    del ctx
    # where a decode token's time goes: the same steps through the timing proxy
    ops = ProfilingOps(make_backend(backend, threads))
    prof = Context(model, params, ops=ops)
    tg(prof)
    ops.reset()
    ops.active = True
    t0 = time.perf_counter()
    tg(prof)
    wall = (time.perf_counter() - t0) * 1e3 / 128
    ops.active = False
    coll = ops.ns.get("collective", 0) / 1e6 / 128
    comp = sum(v for k, v in ops.ns.items() if k != "collective") / 1e6 / 128
    row.tg_ms = {"total": wall, "compute": comp, "collective": coll, "python": max(0.0, wall - comp - coll)}
    for n in npl:
        cp = ContextParams(n_ctx=max(1024, n * 128), n_seq_max=n, n_outputs_max=n, n_threads=threads, backend=backend)
        c = Context(model, cp)
        for s in range(n):
            c.decode(Batch.from_tokens(rng.integers(0, n_vocab, 64).tolist(), 0, s))

        def steps(c: Context = c, n: int = n) -> None:
            for s in range(n):
                c.memory.seq_rm(s, 64)
            for i in range(32):
                toks = rng.integers(0, n_vocab, n).tolist()
                c.decode(Batch([int(t) for t in toks], [64 + i] * n, [[s] for s in range(n)], [True] * n))

        row.s_tg[n] = n * 32 / best(steps, reps)
        del c
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("-t", type=int, default=0, help="threads per rank (0: the cores divided by the ranks)")
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--npl", default="1,4,16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--json")
    a = ap.parse_args()
    path = Path(a.model) if a.model else default_model_path()
    npl = [int(x) for x in a.npl.split(",")]
    cores = len(os.sched_getaffinity(0))
    t1 = a.t or cores
    single = measure(Model.load(path), t1, a.r, npl, a.backend)
    single.rss_mib = [rss_mib()]
    ranks: Ranks = start(a.ranks)
    try:
        tn = a.t or max(1, cores // a.ranks)
        multi = measure(load_shard(ranks.group, str(path), "cpu"), tn, a.r, npl, a.backend)
        multi.rss_mib = [rss_mib(), *(rss_mib(p.pid) for p in ranks.procs)]
    finally:
        ranks.stop()
    rows = [single, multi]
    print(
        f"# tensor parallelism on {cpu_model()} ({cores} cores), {path.name}; threads per rank: 1 rank {t1}, {a.ranks} ranks {tn}"
    )
    print("| ranks | pp512 t/s | tg128 t/s | " + " | ".join(f"S_TG npl={n}" for n in npl) + " |")
    print("|---:|---:|---:|" + "---:|" * len(npl))
    for r in rows:
        print(f"| {r.ranks} | {r.pp512:.1f} | {r.tg128:.1f} | " + " | ".join(f"{r.s_tg[n]:.1f}" for n in npl) + " |")
    print()
    print(
        "| ranks | decode token ms | compute | all-reduce + gather | Python + messages | weights/rank MiB | KV/rank MiB | compute buf MiB | peak RSS per rank MiB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        t = r.tg_ms
        rss = " / ".join(f"{x:.0f}" for x in r.rss_mib)
        print(
            f"| {r.ranks} | {t['total']:.2f} | {t['compute']:.2f} | {t['collective']:.2f} | {t['python']:.2f} | "
            f"{r.weights_mib:.1f} | {r.kv_mib:.1f} | {r.compute_mib:.1f} | {rss} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu_model(), "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
