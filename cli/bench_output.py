"""How `ubatch bench` and `ubatch batched-bench` print: llama-bench's md/csv/json/jsonl and
llama-batched-bench's table/jsonl, plus ubatch's profile and buffer sections and the plot."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engine.bench import (
    CATEGORIES, CATEGORY_TITLES, BatchedHeader, BatchedResult, BenchError, BenchParams, BenchResult,
)

FORMATS = ("md", "csv", "json", "jsonl")
MiB = 1024 * 1024

# llama-bench's csv/json fields (those ubatch has), then ubatch's scalar columns
LLAMA_BENCH_FIELDS = (
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type",
    "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "type_k", "type_v",
    "n_gpu_layers", "flash_attn", "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns", "stddev_ns",
    "avg_ts", "stddev_ts",
)
UBATCH_FIELDS = ("test", "n_ctx", "n_batch_eff", "n_ubatch_eff", "n_outputs_max", "compute_buffer_mib",
                 "used_buffer_mib", "kv_mib", "n_ubatches")


# -- output targets -------------------------------------------------------------------------------

def output_target(value: str, flag: str = "-o") -> tuple[str, Path | None]:
    """-o md|csv|json|jsonl prints to stdout; -o FILE.{md,csv,json,jsonl} writes that file."""
    if value in FORMATS:
        return value, None
    path = Path(value)
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise BenchError(f"{flag} {value!r}: use a format ({', '.join(FORMATS)}) or a file name "
                         f"ending in .md, .csv, .json or .jsonl")
    check_writable(path, flag)
    return fmt, path


def check_writable(path: Path, flag: str) -> None:
    """Fail before the (long) run if the file could not be written afterwards."""
    if path.is_dir():
        raise BenchError(f"{flag} {path}: is a directory, not a file")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise BenchError(f"{flag} {path}: {parent} is not a directory")
    if not parent.is_dir():
        raise BenchError(f"{flag} {path}: directory {parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise BenchError(f"{flag} {path}: file is not writable")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise BenchError(f"{flag} {path}: directory {parent} is not writable")


def write_file(path: Path, text: str, flag: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise BenchError(f"{flag} {path}: cannot write ({e.strerror})") from None


def check_plot_path(path: Path) -> None:
    check_writable(path, "--plot")
    ext = path.suffix.lstrip(".").lower()
    if ext not in ("png", "svg", "pdf", "jpg", "jpeg", "webp"):
        raise BenchError(f"--plot {path}: use a .png, .svg, .pdf, .jpg or .webp file name")


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
WIDTHS = {"model": -30, "size": 10, "params": 10, "backend": -10, "n_threads": 7, "n_batch": 7,
          "n_ubatch": 8, "type_k": 6, "type_v": 6, "n_outputs_max": 13, "test": 15, "t/s": 20, "GB/s": 6,
          "ub_eff": 6, "buffer MiB": 10, "used MiB": 10, "KV MiB": 10}


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
        case "GB/s":  # every matrix is read once per generated token
            return f"{r.model_size * r.avg_ts / 1e9:.2f}" if _is_tg(r) else "-"
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
    return out


def format_json(results: Sequence[BenchResult]) -> str:
    return json.dumps([_json_obj(r) for r in results], indent=2) + "\n"


def format_jsonl(results: Sequence[BenchResult]) -> str:
    return "".join(json.dumps(_json_obj(r)) + "\n" for r in results)


def format_results(fmt: str, p: BenchParams, results: Sequence[BenchResult], extras: bool = False) -> str:
    if fmt == "md":
        text = format_md(p, results)
        return text + ("\n" + format_profile_md(results) if extras else "")
    return {"csv": format_csv, "json": format_json, "jsonl": format_jsonl}[fmt](results)


# -- ubatch's sections: where the time goes, what the buffer holds -----------------------------

def format_profile_md(results: Sequence[BenchResult]) -> str:
    """Per test: time per repetition by op category (ms and share), and the compute buffer's
    largest tensors at the reserved peak and at the peak of the largest graph that ran."""
    lines: list[str] = []
    prof = [r for r in results if r.profile_ms]
    if prof:
        cats = list(CATEGORIES)
        lines.append("where the time goes (ms per repetition, share of the timed run):")
        lines.append("")
        head = ["test", "n_ubatch", "ubatches", "ms"] + [CATEGORY_TITLES[c] for c in cats]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|")
        for r in prof:
            total = sum(r.profile_ms.values()) or 1.0
            cells = [r.test, str(r.n_ubatch_eff), str(r.n_ubatches), f"{total:.1f}"]
            cells += [f"{r.profile_ms.get(c, 0.0):.1f} ({100 * r.profile_ms.get(c, 0.0) / total:.0f}%)"
                      for c in cats]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    seen: set[tuple] = set()
    rows = []
    for r in results:
        key = (r.model_filename, r.n_ctx, r.n_batch_eff, r.n_ubatch_eff, r.n_outputs_max, r.type_k, r.type_v)
        if key in seen:
            continue
        seen.add(key)
        rows.append(r)
    lines.append("compute buffer: reserved (worst case the context plans for) vs used (largest graph "
                 "that ran), and the largest tensors alive at each peak (MiB):")
    lines.append("")
    lines.append("| test | n_ubatch | n_outputs_max | reserved | used | reserved peak holds | used peak holds |")
    lines.append("|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        def top(ts: list, n: int = 4) -> str:
            return ", ".join(f"{t.name} {'x'.join(map(str, t.shape))} {t.mib:.2f}" for t in ts[:n])

        lines.append(f"| {r.test} | {r.n_ubatch_eff} | {r.n_outputs_max} | {r.compute_buffer_mib:.2f} | "
                     f"{r.used_buffer_mib:.2f} | {top(r.buffer_top)} | {top(r.used_top)} |")
    return "\n".join(lines) + "\n"


# -- llama-batched-bench --------------------------------------------------------------------------

def batched_header_line(h: BatchedHeader) -> str:
    return (f"llama_batched_bench: n_kv_max = {h.n_kv_max}, n_batch = {h.n_batch}, n_ubatch = {h.n_ubatch}, "
            f"flash_attn = {h.flash_attn}, is_pp_shared = {h.is_pp_shared}, is_tg_separate = "
            f"{h.is_tg_separate}, n_gpu_layers = {h.n_gpu_layers}, n_threads = {h.n_threads}, "
            f"n_threads_batch = {h.n_threads_batch}")


def batched_md_head() -> str:
    return ("|%6s | %6s | %4s | %6s | %8s | %8s | %8s | %8s | %8s | %8s |\n"
            % ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")
            + "|%6s-|-%6s-|-%4s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|\n"
            % ("------", "------", "----", "------", "--------", "--------", "--------", "--------",
               "--------", "--------"))


def batched_md_row(r: BatchedResult) -> str:
    return ("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |\n"
            % (r.pp, r.tg, r.pl, r.n_kv, r.t_pp, r.speed_pp, r.t_tg, r.speed_tg, r.t, r.speed))


def batched_jsonl_row(h: BatchedHeader, r: BatchedResult) -> str:
    d = {"n_kv_max": h.n_kv_max, "n_batch": h.n_batch, "n_ubatch": h.n_ubatch, "flash_attn": h.flash_attn,
         "is_pp_shared": h.is_pp_shared, "n_gpu_layers": h.n_gpu_layers, "n_threads": h.n_threads,
         "n_threads_batch": h.n_threads_batch, "pp": r.pp, "tg": r.tg, "pl": r.pl, "n_kv": r.n_kv,
         "t_pp": r.t_pp, "speed_pp": r.speed_pp, "t_tg": r.t_tg, "speed_tg": r.speed_tg, "t": r.t,
         "speed": r.speed, "compute_buffer_mib": h.compute_buffer_mib, "kv_mib": h.kv_mib}
    return json.dumps(d) + "\n"


# -- plot -----------------------------------------------------------------------------------------

# parameters a plot may put on its x axis, in order of preference (as the user asked for them)
X_CANDIDATES = ("n_ubatch", "n_batch", "n_depth", "n_threads", "n_outputs_max")
X_LABELS = {"n_ubatch": "-ub (n_ubatch)", "n_batch": "-b (n_batch)", "n_depth": "-d (depth)",
            "n_threads": "-t (threads)", "n_outputs_max": "-nom (n_outputs_max)"}
SERIES_KEYS = ("n_ubatch", "n_batch", "n_depth", "n_threads", "type_k", "type_v", "n_outputs_max")
SHORT = {"n_ubatch": "ub", "n_batch": "b", "n_depth": "d", "n_threads": "t", "type_k": "ctk",
         "type_v": "ctv", "n_outputs_max": "nom"}


def _requested(results: Sequence[BenchResult], tests: Sequence[Any] | None) -> list[dict[str, Any]]:
    """Each result's parameters as the user gave them (the test instance when known: clamps
    per test, such as n_ubatch <= n_ctx, must not make a parameter look varied)."""
    if tests is not None and len(tests) == len(results):
        return [{k: getattr(t, k) for k in SERIES_KEYS} for t in tests]
    return [{k: getattr(r, k) for k in SERIES_KEYS} for r in results]


def write_plot(results: Sequence[BenchResult], path: Path, tests: Sequence[Any] | None = None) -> None:
    """Two panels against the parameter the user varied (-ub first): compute buffer MiB
    (reserved; dashed: the largest graph that ran; dotted: KV) and tokens/s with the stddev as
    error bars, one line per test (and per other varied parameter); a third panel with the op
    profile (µs per token by category) when the run was profiled. With no varied parameter the
    x axis is the tests themselves (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = list(results)
    req = _requested(rs, tests)
    varied = [k for k in SERIES_KEYS if len({q[k] for q in req}) > 1]
    x_key = next((k for k in X_CANDIDATES if k in varied), None)
    series_keys = [k for k in varied if k != x_key]

    def name(i: int, with_x: bool = False, sep: str = " ") -> str:
        parts = [rs[i].test] + [f"{SHORT[k]} {req[i][k]}" for k in series_keys]
        if with_x and x_key is not None:
            parts.append(f"{SHORT[x_key]} {req[i][x_key]}")
        return sep.join(parts)

    groups: dict[str, list[int]] = {}
    for i in range(len(rs)):
        groups.setdefault(name(i), []).append(i)
    profiled = [i for i, r in enumerate(rs) if r.profile_ms]
    if x_key is not None:
        profiled.sort(key=lambda i: (req[i][x_key], name(i)))
    n_panels = 3 if profiled else 2
    fig, axes = plt.subplots(n_panels, 1, figsize=(8, 3.4 * n_panels), constrained_layout=True)
    ax_mem, ax_ts = axes[0], axes[1]
    first = rs[0]
    threads = sorted({r.n_threads for r in rs})
    fig.suptitle(f"ubatch bench: {first.model_type}, {'/'.join(map(str, threads))} threads "
                 f"({first.cpu_info})", fontsize=10)
    if x_key is None:
        xs = list(range(len(rs)))
        ax_mem.bar([x - 0.2 for x in xs], [r.compute_buffer_mib for r in rs], 0.4, label="compute buffer (reserved)")
        ax_mem.bar([x + 0.2 for x in xs], [r.used_buffer_mib for r in rs], 0.4, label="largest graph that ran")
        ax_ts.bar(xs, [r.avg_ts for r in rs], yerr=[r.stddev_ts for r in rs], capsize=4)
        for x, r in zip(xs, rs):
            ax_ts.annotate(f"{r.avg_ts:.0f}", (x, r.avg_ts), fontsize=7, textcoords="offset points",
                           xytext=(0, 6), ha="center")
        for ax in (ax_mem, ax_ts):
            ax.set_xticks(xs, [name(i, sep="\n") for i in xs], fontsize=7)
    else:
        for lab, idx in groups.items():
            idx = sorted(idx, key=lambda i: req[i][x_key])
            g = [rs[i] for i in idx]
            xs = [req[i][x_key] for i in idx]
            line = ax_mem.plot(xs, [r.compute_buffer_mib for r in g], "o-", label=f"{lab}: compute buffer")[0]
            ax_mem.plot(xs, [r.used_buffer_mib for r in g], "s--", color=line.get_color(), alpha=0.7,
                        label=f"{lab}: largest graph that ran")
            for x, r in zip(xs, g):
                ax_mem.annotate(f"{r.compute_buffer_mib:.1f}", (x, r.compute_buffer_mib), fontsize=7,
                                textcoords="offset points", xytext=(0, 5), ha="center")
                if abs(r.used_buffer_mib - r.compute_buffer_mib) > 0.05 * r.compute_buffer_mib:
                    ax_mem.annotate(f"{r.used_buffer_mib:.1f}", (x, r.used_buffer_mib), fontsize=7,
                                    textcoords="offset points", xytext=(0, -11), ha="center",
                                    color=line.get_color())
            ax_ts.errorbar(xs, [r.avg_ts for r in g], yerr=[r.stddev_ts for r in g], fmt="o-", capsize=4,
                           label=lab)
            for x, r in zip(xs, g):
                ax_ts.annotate(f"{r.avg_ts:.0f}", (x, r.avg_ts), fontsize=7, textcoords="offset points",
                               xytext=(0, 6), ha="center")
        xvals = sorted({q[x_key] for q in req})
        for ax in (ax_mem, ax_ts):
            if x_key in ("n_ubatch", "n_batch") and min(xvals) > 0:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xvals, [str(v) for v in xvals])
            ax.minorticks_off()
            ax.set_xlabel(X_LABELS[x_key])
        ax_ts.legend(fontsize=7)
    kv = {r.kv_mib for r in rs}
    if len(kv) == 1:
        ax_mem.axhline(kv.pop(), color="grey", ls=":", lw=1, label=f"KV cache ({rs[0].kv_mib:.1f} MiB)")
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title("compute buffer (reserved worst case; dashed: largest graph that ran)", fontsize=9)
    mem = [v for r in rs for v in (r.compute_buffer_mib, r.used_buffer_mib, r.kv_mib) if v > 0]
    if mem and max(mem) / min(mem) > 20:  # reserved and used differ by orders of magnitude
        ax_mem.set_yscale("log")
        ax_mem.set_ylabel("MiB (log scale)")
    else:
        ax_mem.set_ylim(bottom=0)
    ax_mem.legend(fontsize=7)
    ax_ts.set_ylabel("tokens/s")
    ax_ts.set_title("speed (mean ± stddev over repetitions)", fontsize=9)
    ax_ts.set_ylim(bottom=0)
    for ax in (ax_mem, ax_ts):
        ax.grid(alpha=0.3)
    if profiled:
        ax = axes[2]
        pos = list(range(len(profiled)))
        bottom = [0.0] * len(profiled)
        for c in CATEGORIES:
            vals = [1e3 * rs[i].profile_ms.get(c, 0.0) / max(1, rs[i].n_prompt + rs[i].n_gen) for i in profiled]
            ax.bar(pos, vals, 0.6, bottom=bottom, label=CATEGORY_TITLES[c])
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(pos, [name(i, with_x=True, sep="\n") for i in profiled], fontsize=7 if len(pos) <= 8 else 6)
        ax.set_ylabel("µs per token")
        ax.set_title("where the time goes (op profile)", fontsize=9)
        ax.legend(fontsize=7, ncol=3)
        ax.grid(alpha=0.3, axis="y")
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise BenchError(f"--plot {path}: cannot write ({e.strerror})") from None
    finally:
        plt.close(fig)
