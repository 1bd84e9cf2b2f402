"""How `ubatch bench` prints its results: llama-bench's md, csv, json and jsonl.

They are reproduced column for column so that scripts written for llama-bench's output can read
ubatch's; ubatch's own columns (compute buffer reserved vs used, KV cache) come after
llama.cpp's. The --profile sections are in cli/bench/profile_format.py, llama-batched-bench's
output in cli/bench/batched_format.py.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Sequence
from typing import Any

from ubatch.cli.bench.params import BenchParams
from ubatch.cli.bench.profile_format import format_profile_md
from ubatch.cli.bench.result import BenchResult
from ubatch.engine.units import MiB
from ubatch.kernels.profiling import CATEGORIES

FORMATS = ("md", "csv", "json", "jsonl")

# llama-bench's csv/json fields (those ubatch has), then ubatch's scalar columns
LLAMA_BENCH_FIELDS = (
    "build_commit",
    "build_number",
    "cpu_info",
    "gpu_info",
    "backends",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "type_k",
    "type_v",
    "n_gpu_layers",
    "flash_attn",
    "n_prompt",
    "n_gen",
    "n_depth",
    "test_time",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
)
UBATCH_FIELDS = (
    "test",
    "n_ctx",
    "n_batch_eff",
    "n_ubatch_eff",
    "n_outputs_max",
    "compute_buffer_mib",
    "used_buffer_mib",
    "kv_mib",
    "n_ubatches",
    "stream_bytes",
)


# -- llama-bench formats --------------------------------------------------------------------------


def _size(b: int) -> str:
    return f"{b / 1024**3:.2f} GiB" if b >= 1024**3 else f"{b / MiB:.2f} MiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _is_tg(r: BenchResult) -> bool:
    return r.n_gen > 0 and r.n_prompt == 0


def md_columns(p: BenchParams, results: Sequence[BenchResult]) -> list[str]:
    """llama-bench's rule: a parameter gets a column when it has several values or a
    non-default one (threads always on CPU); ubatch adds `ub eff` when a clamp changed n_ubatch
    for some test, and the buffer columns always."""
    cols = ["model", "size", "params", "backend", "n_threads"]
    if len(p.n_batch) > 1 or p.n_batch != [2048]:
        cols.append("n_batch")
    if len(p.n_ubatch) > 1 or p.n_ubatch != [512]:
        cols.append("n_ubatch")
    if len(p.type_k) > 1 or p.type_k != ["f16"]:
        cols.append("type_k")
    if len(p.type_v) > 1 or p.type_v != ["f16"]:
        cols.append("type_v")
    if len(p.n_outputs_max) > 1 or p.n_outputs_max != [0]:
        cols.append("n_outputs_max")
    cols += ["test", "t/s"]
    if any(_is_tg(r) for r in results):
        cols.append("GB/s")
    if any(r.n_ubatch_eff != r.n_ubatch for r in results):
        cols.append("ub_eff")
    cols += ["buffer MiB", "used MiB", "KV MiB"]
    return cols


HEADERS = {"n_threads": "threads", "n_outputs_max": "n_outputs_max"}
WIDTHS = {
    "model": -30,
    "size": 10,
    "params": 10,
    "backend": -10,
    "n_threads": 7,
    "n_batch": 7,
    "n_ubatch": 8,
    "type_k": 6,
    "type_v": 6,
    "n_outputs_max": 13,
    "test": 15,
    "t/s": 20,
    "GB/s": 6,
    "ub_eff": 6,
    "buffer MiB": 10,
    "used MiB": 10,
    "KV MiB": 10,
}


def _cell(r: BenchResult, col: str) -> str:
    match col:
        case "model":
            return r.model_type
        case "size":
            return _size(r.model_size)
        case "params":
            return _params(r.model_n_params)
        case "backend":
            return r.backends
        case "test":
            return r.test
        case "t/s":
            return f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}"
        case "GB/s":  # every matrix (of experts, the chosen ones) read once per generated token, repacks included
            return f"{(r.stream_bytes or r.model_size) * r.avg_ts / 1e9:.2f}" if _is_tg(r) else "-"
        case "ub_eff":
            return str(r.n_ubatch_eff)
        case "buffer MiB":
            return f"{r.compute_buffer_mib:.2f}"
        case "used MiB":
            return f"{r.used_buffer_mib:.2f}"
        case "KV MiB":
            return f"{r.kv_mib:.2f}"
    return str(getattr(r, col))


def _row(cells: Sequence[str], cols: Sequence[str]) -> str:
    out = "|"
    for c, v in zip(cols, cells):
        w = WIDTHS.get(c, max(len(c), 10))
        w = max(abs(w), len(HEADERS.get(c, c))) * (1 if w > 0 else -1)
        out += f" {v:<{-w}} |" if w < 0 else f" {v:>{w}} |"
    return out


def format_md(p: BenchParams, results: Sequence[BenchResult]) -> str:
    cols = md_columns(p, results)
    lines = [_row([HEADERS.get(c, c) for c in cols], cols)]
    sep = "|"
    for c in cols:
        w = WIDTHS.get(c, max(len(c), 10))
        n = max(abs(w), len(HEADERS.get(c, c)))
        sep += " " + "-" * (n - 1) + (":" if w > 0 else "-") + " |"
    lines.append(sep)
    lines += [_row([_cell(r, c) for c in cols], cols) for r in results]
    lines.append("")
    commit = results[0].build_commit if results else "unknown"
    number = results[0].build_number if results else 0
    lines.append(f"build: {commit} ({number})")
    return "\n".join(lines) + "\n"


def _flat(r: BenchResult) -> dict[str, Any]:
    d = r.to_dict(samples=False)
    out = {k: d[k] for k in (*LLAMA_BENCH_FIELDS, *UBATCH_FIELDS)}
    for c in CATEGORIES if r.profile_ms else ():
        out[f"profile_{c}_ms"] = r.profile_ms.get(c, 0.0)
    return out


def format_csv(results: Sequence[BenchResult]) -> str:
    buf = io.StringIO()
    rows = [_flat(r) for r in results]
    names = list(rows[0]) if rows else [*LLAMA_BENCH_FIELDS, *UBATCH_FIELDS]
    w = csv.DictWriter(buf, names, quoting=csv.QUOTE_ALL, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for row in rows:
        w.writerow(row)
    return buf.getvalue()


def _json_obj(r: BenchResult) -> dict[str, Any]:
    d = r.to_dict(samples=True)
    out = {k: d[k] for k in LLAMA_BENCH_FIELDS}
    out["samples_ns"], out["samples_ts"] = d["samples_ns"], d["samples_ts"]
    out.update({k: d[k] for k in UBATCH_FIELDS})
    out["buffer_top"] = d["buffer_top"]
    out["used_top"] = d["used_top"]
    if r.profile_ms:
        out["profile_ms"] = d["profile_ms"]
        out["profile_work"] = {c: {"flops": f, "bytes": b} for c, (f, b) in r.profile_work.items()}
        out["peaks"] = d["peaks"]  # this CPU's, measured beside the run (None off the C backends)
    return out


def format_json(results: Sequence[BenchResult]) -> str:
    return json.dumps([_json_obj(r) for r in results], indent=2) + "\n"


def format_jsonl(results: Sequence[BenchResult]) -> str:
    return "".join(json.dumps(_json_obj(r)) + "\n" for r in results)


# -- how much the repetitions agree --------------------------------------------------------------

BUSY_SPREAD = 0.10  # repetitions of one test further apart than this: something else ran too


def spread(r: BenchResult) -> float:
    """How far a test's repetitions disagree: (max - min) / median of their t/s. The range, not
    the stddev, because it reads as the caution says ("varied by N%") for any -r, and 2 reps
    (a quick check) give a range as readily as 5; the median keeps one slow outlier from
    shrinking its own share. 0 with fewer than two repetitions."""
    ts = r.samples_ts
    mid = statistics.median(ts) if len(ts) > 1 else 0.0
    return (max(ts) - min(ts)) / mid if mid > 0 else 0.0


def busy_line(results: Sequence[BenchResult], labels: Sequence[str] | None = None) -> str | None:
    """The caution printed after the results when some test's repetitions disagree by more than
    BUSY_SPREAD (None when all agree). On a quiet machine repetitions agree within a few per
    cent; 10% and more means other work shared the cores, so a sweep can look non-monotonic
    and only ratios taken within one run (one load of the machine) mean something. `labels`
    name the tests (default: the test name), the worst one is named."""
    if not results:
        return None
    i = max(range(len(results)), key=lambda k: spread(results[k]))
    worst = spread(results[i])
    if worst <= BUSY_SPREAD:
        return None
    name = labels[i] if labels is not None else results[i].test
    return (
        f"the machine is busy: t/s varied by {100 * worst:.0f}% across repetitions (most in {name}); "
        "compare ratios from one run"
    )


def format_results(fmt: str, p: BenchParams, results: Sequence[BenchResult], extras: bool = False) -> str:
    if fmt == "md":
        text = format_md(p, results)
        return text + ("\n" + format_profile_md(results) if extras else "")
    return {"csv": format_csv, "json": format_json, "jsonl": format_jsonl}[fmt](results)


__all__ = [
    "FORMATS",
    "LLAMA_BENCH_FIELDS",
    "UBATCH_FIELDS",
    "md_columns",
    "format_md",
    "format_csv",
    "format_json",
    "format_jsonl",
    "format_results",
    "BUSY_SPREAD",
    "spread",
    "busy_line",
]
