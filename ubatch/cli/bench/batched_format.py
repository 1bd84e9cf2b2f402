"""How `ubatch batched-bench` prints: llama-batched-bench's header line, table and jsonl rows.

They are copied format string for format string so scripts that parse llama.cpp's
batched-bench output read ubatch's unchanged; the jsonl rows then add ubatch's buffer and KV
sizes, and --profile's table comes after llama's, in ubatch's own format. llama-bench's formats are a different tool's and live in cli/bench/format.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, astuple

from ubatch.cli.bench.batched import BatchedHeader, BatchedResult
from ubatch.cli.bench.profile_format import PeakRow, peaks_md
from ubatch.kernels.profiling import CATEGORIES, CATEGORY_TITLES


def batched_header_line(h: BatchedHeader) -> str:
    return (
        f"llama_batched_bench: n_kv_max = {h.n_kv_max}, n_batch = {h.n_batch}, n_ubatch = {h.n_ubatch}, "
        f"flash_attn = {h.flash_attn}, is_pp_shared = {h.is_pp_shared}, is_tg_separate = "
        f"{h.is_tg_separate}, n_gpu_layers = {h.n_gpu_layers}, n_threads = {h.n_threads}, "
        f"n_threads_batch = {h.n_threads_batch}"
    )


# llama-batched-bench's table: each column's header, width and number format (BatchedResult's order)
_COLUMNS = (
    ("PP", 6, "d"),
    ("TG", 6, "d"),
    ("B", 4, "d"),
    ("N_KV", 6, "d"),
    ("T_PP s", 8, ".3f"),
    ("S_PP t/s", 8, ".2f"),
    ("T_TG s", 8, ".3f"),
    ("S_TG t/s", 8, ".2f"),
    ("T s", 8, ".3f"),
    ("S t/s", 8, ".2f"),
)


def _md_line(cells: Iterable[str]) -> str:
    return "|" + " | ".join(cells) + " |\n"


def batched_md_head() -> str:
    rule = "|" + "-|-".join("-" * w for _, w, _ in _COLUMNS) + "-|\n"
    return _md_line(f"{name:>{w}}" for name, w, _ in _COLUMNS) + rule


def batched_md_row(r: BatchedResult) -> str:
    cells = astuple(r)[: len(_COLUMNS)]  # the profile is not a column of llama's table
    return _md_line(f"{v:{w}{fmt}}" for v, (_, w, fmt) in zip(cells, _COLUMNS, strict=True))


def batched_jsonl_row(h: BatchedHeader, r: BatchedResult) -> str:
    """llama-batched-bench's jsonl fields (its header's but is_tg_separate, then the row's), then
    ubatch's buffer and KV sizes, and with --profile the generation step's ms per op category."""
    head = asdict(h)
    sizes = {k: head.pop(k) for k in ("compute_buffer_mib", "kv_mib")}
    del head["is_tg_separate"]
    row = asdict(r)
    prof, work, peaks = row.pop("profile_ms"), row.pop("profile_work"), row.pop("peaks")
    extra = {
        "profile_ms": prof,
        "profile_work": {c: {"flops": f, "bytes": b} for c, (f, b) in work.items()},
        "peaks": peaks,
    }
    return json.dumps(head | row | sizes | (extra if prof else {})) + "\n"


def batched_profile_md(results: Iterable[BatchedResult]) -> str:
    """--profile: where one generation step's time went (all B sequences decoded together), by
    op category, in ms and as a share of the step; the categories are `ubatch bench --profile`'s."""
    prof = [r for r in results if r.profile_ms]
    if not prof:
        return ""
    head = ["PP", "TG", "B", "ms/step"] + [CATEGORY_TITLES[c] for c in CATEGORIES]
    lines = [
        "where a generation step's time goes (ms per step of all B sequences, share of the step):",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---:"] * len(head)) + "|",
    ]
    for r in prof:
        total = sum(r.profile_ms.values()) or 1.0
        cells = [str(r.pp), str(r.tg), str(r.pl), f"{total:.2f}"]
        cells += [f"{r.profile_ms.get(c, 0.0):.2f} ({100 * r.profile_ms.get(c, 0.0) / total:.0f}%)" for c in CATEGORIES]
        lines.append("| " + " | ".join(cells) + " |")
    rows = [
        PeakRow((str(r.pp), str(r.tg), str(r.pl)), r.profile_ms, r.profile_work, r.peaks)
        for r in prof
        if r.peaks and r.profile_work
    ]
    if rows:
        lines += ["", *peaks_md(["PP", "TG", "B"], rows)]
    return "\n".join(lines) + "\n"
