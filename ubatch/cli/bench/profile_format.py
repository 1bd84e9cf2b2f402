"""The sections `ubatch bench --profile` adds below llama-bench's md table.

llama-bench stops at t/s; these tables say where the time went (op categories per repetition)
and what the compute buffer held at its peaks. They are ubatch's own output, printed only on
request, so they live apart from the column-for-column llama-bench formats.
"""

from __future__ import annotations

from collections.abc import Sequence

from ubatch.cli.bench.result import BenchResult
from ubatch.kernels.profiling import CATEGORIES, CATEGORY_TITLES


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
            cells += [f"{r.profile_ms.get(c, 0.0):.1f} ({100 * r.profile_ms.get(c, 0.0) / total:.0f}%)" for c in cats]
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
    lines.append(
        "compute buffer: reserved (worst case the context plans for) vs used (largest graph that ran), and the largest tensors alive at each peak (MiB):"
    )
    lines.append("")
    lines.append("| test | n_ubatch | n_outputs_max | reserved | used | reserved peak holds | used peak holds |")
    lines.append("|---|---:|---:|---:|---:|---|---|")
    for r in rows:

        def top(ts: list, n: int = 4) -> str:
            return ", ".join(f"{t.name} {'x'.join(map(str, t.shape))} {t.mib:.2f}" for t in ts[:n])

        lines.append(
            f"| {r.test} | {r.n_ubatch_eff} | {r.n_outputs_max} | {r.compute_buffer_mib:.2f} | "
            f"{r.used_buffer_mib:.2f} | {top(r.buffer_top)} | {top(r.used_top)} |"
        )
    return "\n".join(lines) + "\n"
