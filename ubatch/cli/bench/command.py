"""`ubatch bench` (llama-bench) and `ubatch batched-bench` (llama-batched-bench).

Progress goes to stderr (Rich, only on a terminal); results go to stdout in the chosen format,
or to the file given with `-o FILE.ext`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

from ubatch.cli import validate
from ubatch.cli.common import err_console, resolve_model, user_errors
from ubatch.cli.options import in_panel, opt
from ubatch.cli.parallel_flags import ParallelFlags, parallel_options

if TYPE_CHECKING:
    from rich.progress import Progress

    from ubatch.cli.bench.params import BenchTest
    from ubatch.cli.bench.result import BenchEvent

TESTS, PARAMS, RUN, OUT = "Tests", "Parameters (comma lists and ranges: 1-8, 64-512*2, 0-4096+1024)", "Run", "Output"
_tests, _params, _run, _out = (in_panel(p) for p in (TESTS, PARAMS, RUN, OUT))


def _progress(
    total: int, step: Callable[[BenchEvent], tuple[str, str] | None]
) -> tuple[Progress, Callable[[BenchEvent], None]]:
    """The progress bar on stderr (a terminal only) and the event callback that moves it: notes,
    the model load and each finished test alike for both benchmarks; `step` says what a
    repetition shows, as (description, rep) (None: nothing for that event)."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rep]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )
    task = progress.add_task("starting", total=total, rep="")

    def on_event(e: BenchEvent) -> None:
        if e.kind == "note":
            progress.console.print(f"[yellow]note:[/] {escape(e.text)}", highlight=False)
        elif e.kind == "load":
            progress.update(task, description=f"loading {Path(e.text).name}")
        elif e.kind == "done":
            progress.update(task, completed=e.test_index)
        elif (shown := step(e)) is not None:
            description, rep = shown
            progress.update(task, description=description, rep=rep)

    return progress, on_event


def _test_label(t: BenchTest) -> str:
    parts = [t.name, f"b {t.n_batch}", f"ub {t.n_ubatch}"]
    if t.type_k != "f16" or t.type_v != "f16":
        parts.append(f"kv {t.type_k}/{t.type_v}")
    if t.n_threads:
        parts.append(f"t {t.n_threads}")
    return ", ".join(parts)


@user_errors
@parallel_options
def bench(
    model: Optional[List[Path]] = opt(
        "model", None, help="GGUF file(s) (default: Gemma 3 270M Q4_K_M, bundled)", panel=TESTS
    ),
    n_prompt: Optional[List[str]] = _tests(
        None, "-p", "--n-prompt", help="prompt tokens of the pp tests", show_default="512"
    ),
    n_gen: Optional[List[str]] = _tests(
        None, "-n", "--n-gen", help="generated tokens of the tg tests", show_default="128"
    ),
    pg: Optional[List[str]] = _tests(None, "-pg", help="pp,tg: a prompt then generation test (repeatable)"),
    depth: Optional[List[str]] = _params(
        None, "-d", "--n-depth", help="tokens already in the cache before each test", show_default="0"
    ),
    batch_size: Optional[List[str]] = opt("batch_size", None, show_default="2048", panel=PARAMS),
    ubatch_size: Optional[List[str]] = opt("ubatch_size", None, show_default="512", panel=PARAMS),
    ctk: Optional[List[str]] = opt("ctk", None, show_default="f16", panel=PARAMS),
    ctv: Optional[List[str]] = opt("ctv", None, show_default="f16", panel=PARAMS),
    threads: Optional[List[str]] = opt("threads", None, show_default="all", panel=PARAMS),
    backend: str = opt("backend", "auto", panel=PARAMS),
    device: str = opt("device", "auto", panel=PARAMS),
    n_outputs_max: Optional[List[str]] = _params(
        None,
        "-nom",
        "--n-outputs-max",
        help="logit rows the compute buffer is planned for (0 = n_batch, llama-bench's)",
        show_default="0",
    ),
    reps: int = _run(5, "-r", "--repetitions", help="timed repetitions per test"),
    no_warmup: bool = _run(False, "--no-warmup", help="skip the untimed warm-up run"),
    delay: float = _run(0.0, "--delay", help="seconds to wait between tests"),
    profile: bool = _run(
        False, "--profile", help="time every op: where prefill time goes, and what the compute buffer holds"
    ),
    sweep_ub: Optional[str] = _run(
        None, "--sweep-ub", help="the -ub sweep: same as -ub LIST -n 0 --plot ub-sweep.png (explicit -n/--plot win)"
    ),
    output: str = _out(
        "md", "-o", "--output", help="md, csv, json, jsonl; or FILE.{md,csv,json,jsonl} to write a file"
    ),
    output_err: Optional[str] = _out(None, "-oe", "--output-err", help="also print this format to stderr"),
    plot: Optional[Path] = _out(
        None, "--plot", help="write a PNG/SVG/PDF: compute buffer and t/s against the varying parameter"
    ),
    tp: ParallelFlags = ParallelFlags(),
) -> None:
    from ubatch.cli.bench.params import BenchError, BenchParams, check_params, expand, int_list, pair_list, str_list

    # the lists and numbers first: bench_params and validate answer a typo before torch loads
    ub_flag, ub_values = "-ub", ubatch_size
    if sweep_ub is not None:
        if ubatch_size:
            raise BenchError("--sweep-ub and -ub both give the -ub list; use one of them")
        ub_flag, ub_values = "--sweep-ub", [sweep_ub]
        n_gen = ["0"] if n_gen is None else n_gen
        plot = Path("ub-sweep.png") if plot is None else plot
    p = BenchParams(
        models=[],
        n_prompt=int_list(n_prompt, [512], "-p", 0, "n_prompt"),
        n_gen=int_list(n_gen, [128], "-n", 0, "n_gen"),
        n_pg=pair_list(pg),
        n_depth=int_list(depth, [0], "-d", 0, "n_depth"),
        n_batch=int_list(batch_size, [2048], "-b", 1, "n_batch"),
        n_ubatch=int_list(ub_values, [512], ub_flag, 1 if sweep_ub is not None else 0, "n_ubatch"),
        n_outputs_max=int_list(n_outputs_max, [0], "-nom", 0, "n_outputs_max"),
        n_threads=int_list(threads, [0], "-t", 1, "n_threads"),  # the default 0 = every core
        reps=validate.positive("-r", reps, "reps"),
        warmup=not no_warmup,
        profile=profile,
        delay=validate.finite("--delay", delay, "delay", 0.0),
        backend=backend,
    )
    from ubatch.cli.bench.format import FORMATS, busy_line, format_results
    from ubatch.cli.bench.plot import write_plot
    from ubatch.cli.bench.run import run_bench
    from ubatch.cli.bench.target import check_plot_path, output_target, write_file
    from ubatch.engine.kv.cache import KV_TYPES

    validate.backend(backend)
    from ubatch.cli.device import load_on, resolve_device

    dev, p.backend = resolve_device(device, backend)
    tp.check()
    tp.follow(dev)
    p.type_k = str_list(ctk, ["f16"], "-ctk", KV_TYPES)
    p.type_v = str_list(ctv, ["f16"], "-ctv", KV_TYPES)
    fmt, out_path = output_target(output, "-o")
    if output_err is not None:
        validate.choice("-oe", output_err, "output format", FORMATS)
    if plot is not None:
        check_plot_path(plot)
    check_params(p)
    p.models = [Path(m) for m in model] if model else [resolve_model(None)]
    for m in p.models:
        if not m.exists():  # a GGUF file or a checkpoint directory (Model.load says which is wrong)
            raise BenchError(f"{m}: model file not found")
    tests = expand(p)
    if not tests:
        raise BenchError("nothing to run: every -p, -n and -pg value is 0")

    from ubatch.cli.bench.graphs import GraphTally

    tally = GraphTally()

    def step(e: BenchEvent) -> tuple[str, str] | None:
        if e.kind not in ("warmup", "rep") or e.test is None:
            return None
        rep = "warm-up" if e.kind == "warmup" else f"rep {e.rep}/{e.n_reps}"
        return f"test {e.test_index}/{e.n_tests}: {_test_label(e.test)}", rep

    progress, show = _progress(len(tests), step)

    def on_event(e: BenchEvent) -> None:
        tally.on_event(e, _test_label)
        show(e)

    with progress:
        loaded = {m: tp.load(m, dev) for m in p.models} if tp.active else load_on(p.models, dev)
        results = run_bench(p, on_event, loaded)
    text = format_results(fmt, p, results, extras=profile)
    if out_path is not None:
        write_file(out_path, text, "-o")
        err_console.print(f"wrote {out_path}", highlight=False)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    if output_err is not None:
        sys.stderr.write(format_results(output_err, p, results, extras=profile))
    labels = [_test_label(t) for t in tests] if len(tests) == len(results) else None
    if (busy := busy_line(results, labels)) is not None:
        from rich.markup import escape

        err_console.print(f"[yellow]note:[/] {escape(busy)}", soft_wrap=True)
    if p.backend == "cuda":  # captures and replays per test, beside llama-bench's own columns
        sys.stderr.write("".join(f"{line}\n" for line in tally.lines()))
    if plot is not None:
        write_plot(results, plot, tests)
        err_console.print(f"wrote {plot}", highlight=False)


@user_errors
@parallel_options
def batched_bench(
    model: Optional[Path] = opt("model", None, panel=TESTS),
    npp: Optional[List[str]] = _tests(None, "-npp", help="prompt lengths", show_default="128,256,512"),
    ntg: Optional[List[str]] = _tests(None, "-ntg", help="generation lengths", show_default="128,256"),
    npl: Optional[List[str]] = _tests(None, "-npl", help="parallel sequences", show_default="1,2,4,8,16,32"),
    pps: bool = _tests(False, "-pps", help="the prompt is shared by all sequences"),
    tgs: bool = _tests(False, "-tgs", help="generate for the sequences one after another"),
    ctx_size: int = opt("ctx_size", 0, help="context size = n_kv_max (0 = from the model)", panel=PARAMS),
    batch_size: int = opt("batch_size", 2048, panel=PARAMS),
    ubatch_size: int = opt("ubatch_size", 512, panel=PARAMS),
    threads: int = opt("threads", -1, panel=PARAMS),
    backend: str = opt("backend", "auto", panel=PARAMS),
    device: str = opt("device", "auto", panel=PARAMS),
    ctk: str = opt("ctk", "f16", panel=PARAMS),
    ctv: str = opt("ctv", "f16", panel=PARAMS),
    kvu: bool = opt("kv_unified", False, help="one KV stream shared by all sequences", panel=PARAMS),
    output_format: str = _out("md", "--output-format", help="md or jsonl"),
    profile: bool = _run(
        False, "--profile", help="time every op of the generation steps: where a step of B sequences goes"
    ),
    tp: ParallelFlags = ParallelFlags(),
) -> None:
    from ubatch.cli.bench.params import BenchError, int_list

    validate.choice("--output-format", output_format, "output format", ("md", "jsonl"))
    validate.context_flags(ctx_size, batch_size, ubatch_size, threads)
    n_pp = int_list(npp, [128, 256, 512], "-npp", 0, "n_pp")
    n_tg = int_list(ntg, [128, 256], "-ntg", 0, "n_tg")
    n_pl = int_list(npl, [1, 2, 4, 8, 16, 32], "-npl", 1, "n_pl")
    for v in n_pl:  # these import the engine's tables: last
        validate.n_parallel(v, flag="-npl")
    validate.kv_types(ctk, ctv)
    validate.backend(backend)
    from ubatch.cli.bench.batched import BatchedParams, run_batched_bench
    from ubatch.cli.device import load_on, resolve_device

    dev, backend = resolve_device(device, backend)
    tp.check()
    tp.follow(dev)
    from ubatch.cli.bench.batched_format import (
        batched_header_line,
        batched_jsonl_row,
        batched_md_head,
        batched_md_row,
        batched_profile_md,
    )

    p = BatchedParams(
        model=resolve_model(model),
        n_ctx=ctx_size,
        n_batch=batch_size,
        n_ubatch=ubatch_size,
        n_threads=threads if threads > 0 else 0,
        type_k=ctk,
        type_v=ctv,
        n_pp=n_pp,
        n_tg=n_tg,
        n_pl=n_pl,
        pps=pps,
        tgs=tgs,
        kvu=kvu,
        backend=backend,
        profile=profile,
    )
    if not p.model.exists():
        raise BenchError(f"{p.model}: model file not found")
    n_combos = len(p.n_pp) * len(p.n_tg) * len(p.n_pl)

    def step(e: BenchEvent) -> tuple[str, str] | None:
        return (f"combination {e.test_index}/{e.n_tests}: {e.text}", "") if e.kind == "rep" else None

    progress, on_event = _progress(n_combos, step)
    with progress:
        loaded = {p.model: tp.load(p.model, dev)} if tp.active else load_on([p.model], dev)
        header, results = run_batched_bench(p, on_event, loaded[p.model] if loaded else None)
    out = sys.stdout
    if output_format == "md":
        out.write("\n" + batched_header_line(header) + "\n")
        out.write(
            f"ubatch: compute buffer = {header.compute_buffer_mib:.2f} MiB, KV cache = {header.kv_mib:.2f} MiB\n\n"
        )
        out.write(batched_md_head())
        for r in results:
            out.write(batched_md_row(r))
        if prof := batched_profile_md(results):
            out.write("\n" + prof)
    else:
        for r in results:
            out.write(batched_jsonl_row(header, r))
    out.flush()
