"""llama-bench's procedure: load, warm up, time `reps` repetitions of every test.

One model load per model and one context per distinct context configuration (a test that only
changes -p or -n reuses the last one); each test is a warm-up, then timed repetitions from an
empty cache with random tokens. Besides llama-bench's timings a result records the compute
buffer the context reserved, the largest graph that actually ran, the KV cache and, with
`profile=True`, where the time went op by op. Nothing here prints: progress goes to a callback.
It drives the engine for `ubatch bench` (and scripts/bench_cpu.py) alone, so it sits in cli/bench/.
"""

from __future__ import annotations

import datetime as _dt
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ubatch.cli.bench.params import BenchParams, check_params, check_tests, expand
from ubatch.cli.bench.result import BenchEvent, BenchResult, TensorShare
from ubatch.cli.sysinfo import build_info, cpu_info, model_description
from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context, make_backend
from ubatch.engine.graph.forward import GraphShape
from ubatch.engine.graph.graph import Graph
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams, derive
from ubatch.engine.units import mib
from ubatch.kernels.ops import Ops
from ubatch.kernels.profiling import ProfilingOps


class BenchContext(Context):
    """A Context that remembers the largest graph it actually ran (vs the one it reserved for)."""

    def __init__(self, model: Model, params: ContextParams, ops: Ops | None = None) -> None:
        self.largest: Graph | None = None
        super().__init__(model, params, ops=ops)

    def graph_for(self, shape: GraphShape) -> Graph:
        g = super().graph_for(shape)
        if self.largest is None or g.size > self.largest.size:
            self.largest = g
        return g


def _shares(peak: list[tuple[str, tuple[int, ...], int]], n: int = 8) -> list[TensorShare]:
    return [TensorShare(name, tuple(shape), mib(b)) for name, shape, b in peak[:n]]


def kv_bytes(ctx: Context) -> int:
    """The KV cache's K and V rows, every cache of the context together."""
    return sum(i.k_bytes + i.v_bytes for i in (c.info() for c in ctx.memory.caches))


def random_tokens(rng: np.random.Generator, n_vocab: int, n: int) -> list[int]:
    """n uniform token ids: the bench measures speed, so the text need not mean anything."""
    return rng.integers(0, n_vocab, size=n).tolist()


def run_prompt(ctx: Context, n_prompt: int, rng: np.random.Generator) -> None:
    """test_prompt: random tokens (BOS first if the vocab adds one) in n_batch chunks, each chunk
    one decode with only its last token as an output, appended to sequence 0."""
    v, n_vocab, nb = ctx.model.vocab, ctx.model.hparams.n_vocab, ctx.cparams.n_batch
    pos = ctx.memory.seq_pos_max(0) + 1
    done = 0
    while done < n_prompt:
        n = min(n_prompt - done, nb)
        toks = random_tokens(rng, n_vocab, n)
        if done == 0 and v.add_bos:
            toks[0] = v.bos
        ctx.decode(Batch.from_tokens(toks, pos + done))
        done += n


def profiling_ops(backend: str, cparams: ContextParams, model: Model) -> ProfilingOps:
    """The backend a context of these parameters would take, with a timer around every op (--profile)."""
    return ProfilingOps(make_backend(backend, derive(cparams, model.hparams).n_threads))


def run_gen(ctx: Context, n_gen: int, rng: np.random.Generator) -> None:
    """test_gen: n_gen single-token decodes (BOS first if the vocab adds one, then random)."""
    v, n_vocab = ctx.model.vocab, ctx.model.hparams.n_vocab
    tok = v.bos if v.add_bos else int(rng.integers(0, n_vocab))
    pos = ctx.memory.seq_pos_max(0) + 1
    for i in range(n_gen):
        ctx.decode(Batch.from_tokens([tok], pos + i))
        tok = int(rng.integers(0, n_vocab))


def _stats(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n-1; 0 for one sample), as llama-bench."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def run_bench(
    p: BenchParams, on_event: Callable[[BenchEvent], None] | None = None, models: dict[Path, Model] | None = None
) -> list[BenchResult]:
    """Run every test of `expand(p)`; `models` may hold already-loaded models by path."""
    emit = on_event or (lambda e: None)
    check_params(p)
    tests = expand(p)
    models = dict(models or {})
    for path in dict.fromkeys(t.model for t in tests):
        if path not in models:
            emit(BenchEvent("load", text=str(path)))
            models[path] = Model.load(path)
            for w in models[path].vocab.warnings:
                emit(BenchEvent("note", text=f"load: {w}"))
    check_tests(tests, {k: m.hparams.n_ctx_train for k, m in models.items()})
    warned: set[tuple[int, int]] = set()
    for t in tests:
        if t.n_ubatch > t.n_batch and (t.n_batch, t.n_ubatch) not in warned:
            warned.add((t.n_batch, t.n_ubatch))
            emit(
                BenchEvent(
                    "note",
                    text=f"-ub {t.n_ubatch} > -b {t.n_batch}: n_ubatch is clamped to {t.n_batch} (llama.cpp: n_ubatch = min(n_batch, ub))",
                )
            )
    commit, number = build_info()
    results: list[BenchResult] = []
    ctx: BenchContext | None = None
    ops: ProfilingOps | None = None
    ctx_key: tuple | None = None
    said: set[str] = set()
    for ti, t in enumerate(tests, 1):
        model = models[t.model]
        if ctx is None or ctx_key != t.context_key:
            ctx = ops = None  # free the previous context's KV cache and workspace first
            cparams = t.context_params()
            ops = profiling_ops(t.backend, cparams, model) if p.profile else None
            ctx = BenchContext(model, cparams, ops=ops)
            ctx_key = t.context_key
            emit(BenchEvent("context", ti, len(tests), test=t))
            why = "; ".join(ctx.ops.dispatch)
            if why and why not in said:  # which builds run, and why
                said.add(why)
                emit(BenchEvent("note", ti, len(tests), text=f"kernels: {why}"))
        torch.set_num_threads(ctx.cparams.n_threads)
        ctx.largest = None  # per test, even when the context carries over from the last one
        started = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        rng = np.random.default_rng(p.seed + ti)
        if p.warmup:
            emit(BenchEvent("warmup", ti, len(tests), 0, p.reps, t))
            ctx.memory.clear()
            if t.n_prompt:
                run_prompt(ctx, t.n_prompt, rng)
            if t.n_gen:
                run_gen(ctx, 1, rng)
        peaks = ops.machine_peaks() if ops is not None else None  # measured before the timed runs
        if ops is not None:
            ops.reset()
        samples: list[int] = []
        n_ub = 0
        for r in range(1, p.reps + 1):
            emit(BenchEvent("rep", ti, len(tests), r, p.reps, t))
            ctx.memory.clear()
            if t.n_depth:
                run_prompt(ctx, t.n_depth, rng)  # not timed
            n_ub0 = ctx.perf.n_ubatch
            if ops is not None:
                ops.active = True
            t0 = time.perf_counter_ns()
            if t.n_prompt:
                run_prompt(ctx, t.n_prompt, rng)
            if t.n_gen:
                run_gen(ctx, t.n_gen, rng)
            dt = time.perf_counter_ns() - t0
            if ops is not None:
                ops.active = False
            samples.append(dt)
            n_ub = ctx.perf.n_ubatch - n_ub0
        n_tok = t.n_prompt + t.n_gen
        avg_ns, sd_ns = _stats([float(s) for s in samples])
        ts = [1e9 * n_tok / s for s in samples]
        avg_ts, sd_ts = _stats(ts)
        profile: dict[str, float] = {}
        work: dict[str, tuple[float, float]] = {}
        if ops is not None:
            profile, work = ops.split_ms(p.reps, avg_ns / 1e6), ops.work_per_run(p.reps)
        cp = ctx.cparams
        kv = kv_bytes(ctx)
        used = ctx.largest
        res = BenchResult(
            build_commit=commit,
            build_number=number,
            cpu_info=cpu_info(),
            gpu_info="",
            backends=f"CPU ({ctx.ops.name})",
            model_filename=str(t.model),
            model_type=model_description(model),
            model_size=model.size_bytes,
            model_n_params=model.n_params,
            n_batch=t.n_batch,
            n_ubatch=t.n_ubatch,
            n_threads=cp.n_threads,
            type_k=t.type_k,
            type_v=t.type_v,
            n_gpu_layers=0,
            flash_attn=1,
            n_prompt=t.n_prompt,
            n_gen=t.n_gen,
            n_depth=t.n_depth,
            test_time=started,
            avg_ns=int(round(avg_ns)),
            stddev_ns=int(round(sd_ns)),
            avg_ts=avg_ts,
            stddev_ts=sd_ts,
            samples_ns=samples,
            samples_ts=ts,
            test=t.name,
            n_ctx=cp.n_ctx,
            n_batch_eff=cp.n_batch,
            n_ubatch_eff=cp.n_ubatch,
            n_outputs_max=cp.n_outputs_max,
            stream_bytes=model.active_bytes + repack_bytes(ctx.ops),  # a mixture of experts: the chosen ones
            compute_buffer_mib=mib(ctx.reservation.bytes),
            used_buffer_mib=mib(used.size if used else 0),
            kv_mib=mib(kv),
            n_ubatches=n_ub,
            buffer_top=_shares(ctx.reservation.peak),
            used_top=_shares(used.describe_peak()) if used else [],
            profile_ms=profile,
            profile_work=work,
            peaks=peaks,
        )
        results.append(res)
        emit(BenchEvent("done", ti, len(tests), p.reps, p.reps, t, res))
        if p.delay > 0 and ti < len(tests):
            time.sleep(p.delay)
    return results


__all__ = ["BenchContext", "kv_bytes", "repack_bytes", "random_tokens", "run_prompt", "run_gen", "run_bench"]


def repack_bytes(ops: Ops) -> int:
    """Bytes a pass over the weights reads beyond the stored ones (the CPU backend's repacks)."""
    return ops.extra_read_bytes()
