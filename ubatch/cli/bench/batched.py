"""llama-batched-bench: throughput of several sequences decoded together.

Where llama-bench times one sequence per test, this fills the KV cache with `pl` parallel
sequences (`-npl`) of `pp` prompt tokens and then generates `tg` tokens for each, the way a
server with `pl` busy slots works; it reports the prompt, generation and total speed per
combination of -npp x -ntg x -npl, with llama-batched-bench's header line and table, and on
request (--profile) where a generation step's time went, op category by category.
It serves `ubatch batched-bench` alone, so it sits in cli/bench/, above the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ubatch.cli.bench.params import BenchError
from ubatch.cli.bench.result import BenchEvent
from ubatch.cli.bench.run import kv_bytes, profiling_ops, random_tokens
from ubatch.cli.context_flags import context_params
from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.units import mib
from ubatch.kernels.cpu.peaks import MachinePeaks


@dataclass(slots=True)
class BatchedParams:
    """llama-batched-bench's parameters (its defaults: -npp 128,256,512 -ntg 128,256
    -npl 1,2,4,8,16,32; -c 0 = the training context)."""

    model: Path
    n_ctx: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 0
    type_k: str = "f16"
    type_v: str = "f16"
    n_pp: list[int] = field(default_factory=lambda: [128, 256, 512])
    n_tg: list[int] = field(default_factory=lambda: [128, 256])
    n_pl: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    pps: bool = False  # the prompt is shared by all sequences
    tgs: bool = False  # generate the sequences one after another
    kvu: bool = False  # one unified KV stream
    backend: str = "auto"
    seed: int = 1
    profile: bool = False  # time every op of the generation steps (ubatch's own, not llama.cpp's)


@dataclass(slots=True)
class BatchedHeader:
    """llama-batched-bench's header line, plus the compute buffer and KV cache sizes."""

    n_kv_max: int
    n_batch: int
    n_ubatch: int
    flash_attn: int
    is_pp_shared: int
    is_tg_separate: int
    n_gpu_layers: int
    n_threads: int
    n_threads_batch: int
    compute_buffer_mib: float
    kv_mib: float


@dataclass(slots=True)
class BatchedResult:
    """One row of llama-batched-bench's table (and its jsonl fields)."""

    pp: int
    tg: int
    pl: int
    n_kv: int
    t_pp: float
    speed_pp: float
    t_tg: float
    speed_tg: float
    t: float
    speed: float
    # --profile: ms per generation step (all pl sequences) by op category, the rest as "overhead";
    # (flops, bytes read) per step by category, and the CPU's peaks
    profile_ms: dict[str, float] = field(default_factory=dict)
    profile_work: dict[str, tuple[float, float]] = field(default_factory=dict)
    peaks: MachinePeaks | None = None


def n_ctx_required(pp: int, tg: int, pl: int, pps: bool, kvu: bool) -> int:
    """KV cells one combination needs (a shared prompt is stored once with one unified stream)."""
    return ((pp if kvu else pl * pp) + pl * tg) if pps else pl * (pp + tg)


def batched_header(ctx: Context, p: BatchedParams) -> BatchedHeader:
    cp = ctx.cparams
    kv = kv_bytes(ctx)
    return BatchedHeader(
        cp.n_ctx,
        cp.n_batch,
        cp.n_ubatch,
        1,
        int(p.pps),
        int(p.tgs),
        0,
        cp.n_threads,
        cp.n_threads,
        mib(ctx.reservation.bytes),
        mib(kv),
    )


def _decode_chunks(ctx: Context, batch: Batch) -> None:
    """decode_helper: the batch in views of n_batch slots."""
    nb = ctx.cparams.n_batch
    for i in range(0, batch.n_tokens, nb):
        ctx.decode(
            Batch(batch.token[i : i + nb], batch.pos[i : i + nb], batch.seq_id[i : i + nb], batch.logits[i : i + nb])
        )


def run_batched_bench(
    p: BatchedParams, on_event: Callable[[BenchEvent], None] | None = None, model: Model | None = None
) -> tuple[BatchedHeader, list[BatchedResult]]:
    """Every -npp x -ntg x -npl combination that fits the context, in one context."""
    emit = on_event or (lambda e: None)
    for name, vals in (("-npp", p.n_pp), ("-ntg", p.n_tg), ("-npl", p.n_pl)):
        if not vals or any(v < 0 for v in vals):
            raise BenchError(f"{name}: needs non-negative values")
    if any(v < 1 for v in p.n_pl):
        raise BenchError("-npl: every value must be at least 1")
    if model is None:
        emit(BenchEvent("load", text=str(p.model)))
        model = Model.load(p.model)
        for w in model.vocab.warnings:
            emit(BenchEvent("note", text=f"load: {w}"))
    params = context_params(
        ctx_size=p.n_ctx,
        batch_size=p.n_batch,
        ubatch_size=p.n_ubatch,
        parallel=max(p.n_pl),
        kv_unified=p.kvu,
        ctk=p.type_k,
        ctv=p.type_v,
        threads=p.n_threads,
        backend=p.backend,
        n_outputs_max=0,  # n_batch, as llama-batched-bench
    )
    ops = profiling_ops(p.backend, params, model) if p.profile else None
    ctx = Context(model, params, ops=ops)
    cp = ctx.cparams
    header = batched_header(ctx, p)
    rng = np.random.default_rng(p.seed)
    n_vocab = model.hparams.n_vocab
    # warm-up: 16 random tokens
    ctx.decode(Batch.from_tokens(random_tokens(rng, n_vocab, min(16, cp.n_batch)), 0))
    ctx.memory.clear()
    combos = [(pp, tg, pl) for pp in p.n_pp for tg in p.n_tg for pl in p.n_pl]
    results: list[BatchedResult] = []
    for ci, (pp, tg, pl) in enumerate(combos, 1):
        need = n_ctx_required(pp, tg, pl, p.pps, p.kvu)
        if need > cp.n_ctx:
            emit(
                BenchEvent(
                    "note",
                    ci,
                    len(combos),
                    text=f"skipping PP {pp} TG {tg} B {pl}: needs {need} KV cells > n_kv_max {cp.n_ctx}",
                )
            )
            continue
        if not p.kvu and pp + tg > cp.n_ctx_seq:
            emit(
                BenchEvent(
                    "note",
                    ci,
                    len(combos),
                    text=f"skipping PP {pp} TG {tg} B {pl}: a sequence needs {pp + tg} cells > {cp.n_ctx_seq} per stream (-c / {max(p.n_pl)} seqs; try -kvu)",
                )
            )
            continue
        emit(BenchEvent("rep", ci, len(combos), 1, 1, text=f"PP {pp} TG {tg} B {pl}"))
        if tg:  # warm-up of the generation step's graph (bound once per shape, ~40 ms), untimed
            ctx.memory.clear()
            warm = Batch()
            for s in range(1 if p.tgs else pl):
                warm.add(int(rng.integers(0, n_vocab)), 0, s, True)
            _decode_chunks(ctx, warm)
        batch = Batch()
        for s in range(1 if p.pps else pl):
            for j in range(pp):
                batch.add(int(rng.integers(0, n_vocab)), j, s, j == pp - 1)
        ctx.memory.clear()
        t0 = time.perf_counter()
        if batch.n_tokens:
            _decode_chunks(ctx, batch)
        if p.pps and pp:
            for s in range(1, pl):
                ctx.memory.seq_cp(0, s)
            if not p.kvu:  # one dummy token applies the copies to the other streams
                ctx.decode(Batch.from_tokens([int(rng.integers(0, n_vocab))], pp, 0))
                ctx.memory.seq_rm(0, pp, -1)
        t_pp = time.perf_counter() - t0
        peaks = ops.machine_peaks() if ops is not None else None  # once a process, before the timed steps
        if ops is not None:
            ops.reset()
            ops.active = True
        t1 = time.perf_counter()
        for i in range(tg):
            if p.tgs:
                for s in range(pl):
                    ctx.decode(Batch.from_tokens([int(rng.integers(0, n_vocab))], pp + i, s))
            else:
                b = Batch()
                for s in range(pl):
                    b.add(int(rng.integers(0, n_vocab)), pp + i, s, True)
                _decode_chunks(ctx, b)
        t_tg = time.perf_counter() - t1
        profile: dict[str, float] = {}
        work: dict[str, tuple[float, float]] = {}
        if ops is not None and tg:
            ops.active = False
            profile, work = ops.split_ms(tg, 1e3 * t_tg / tg), ops.work_per_run(tg)
        n_pp_tok = pp if p.pps else pl * pp
        total = t_pp + t_tg
        res = BatchedResult(
            pp,
            tg,
            pl,
            need,
            t_pp,
            n_pp_tok / t_pp if t_pp > 0 else 0.0,
            t_tg,
            pl * tg / t_tg if t_tg > 0 else 0.0,
            total,
            (n_pp_tok + pl * tg) / total if total > 0 else 0.0,
            profile,
            work,
            peaks,
        )
        results.append(res)
        emit(BenchEvent("done", ci, len(combos), 1, 1, text=f"PP {pp} TG {tg} B {pl}"))
    return header, results


__all__ = ["BatchedParams", "BatchedHeader", "BatchedResult", "n_ctx_required", "batched_header", "run_batched_bench"]
