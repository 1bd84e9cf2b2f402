"""The sections `ubatch bench --profile` adds below llama-bench's md table.

llama-bench stops at t/s; these tables say where the time went (op categories per repetition)
and what the compute buffer held at its peaks. They are ubatch's own output, printed only on
request, so they live apart from the column-for-column llama-bench formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ubatch.cli.bench.result import BenchResult
from ubatch.kernels.cpu.peaks import MachinePeaks
from ubatch.kernels.profiling import CATEGORIES, CATEGORY_TITLES

PEAK_CATEGORIES = ("matmul", "lm_head", "attention")


def _pct(x: float, peak: float) -> str:
    return f"{100 * x / peak:.0f}%" if peak > 0 else "-"


@dataclass(frozen=True, slots=True)
class PeakRow:
    """One profiled run to set against the peaks: its label cells, ms and (flops, bytes) by category."""

    label: tuple[str, ...]
    ms: dict[str, float]
    work: dict[str, tuple[float, float]]
    peaks: MachinePeaks


def peaks_md(label_head: Sequence[str], rows: Sequence[PeakRow]) -> list[str]:
    """The products' and attention's achieved rates against the CPU's peaks: flop/s against the
    f32 FMA and the integer dot-product peaks (which one bounds an op depends on its kernel path:
    `info` names it), bytes read per second against a plain streaming read; the nearer peak says
    whether the op ran compute- or memory-bound. Shared by `bench` and `batched-bench`."""
    if not rows:
        return []
    lines: list[str] = []
    for desc in dict.fromkeys(r.peaks.describe() for r in rows):
        lines.append(f"against this machine's peaks (measured beside the run; {desc}):")
    lines.append("")
    head = [
        *label_head,
        "op",
        "ms",
        "GFLOP/s",
        "of FMA peak",
        "of int16 dot",
        "of int8 dot",
        "GB/s read",
        "of read peak",
        "nearer",
    ]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] * (len(label_head) + 1) + ["---:"] * 7 + ["---"]) + "|")
    for r in rows:
        pk = r.peaks
        for c in PEAK_CATEGORIES:
            ms = r.ms.get(c, 0.0)
            if c not in r.work or ms <= 0:
                continue
            flops, nbytes = r.work[c]
            fs, bs = flops / (ms / 1e3), nbytes / (ms / 1e3)
            nearer = "memory" if pk.read_bytes > 0 and bs / pk.read_bytes > fs / max(pk.fma_flops, 1.0) else "compute"
            cells = [*r.label, CATEGORY_TITLES[c], f"{ms:.2f}", f"{fs / 1e9:.1f}", _pct(fs, pk.fma_flops)]
            cells += [_pct(fs, pk.dot16_ops), _pct(fs, pk.dot8_ops), f"{bs / 1e9:.1f}", _pct(bs, pk.read_bytes), nearer]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


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
        lines += peaks_md(
            ["test"],
            [PeakRow((r.test,), r.profile_ms, r.profile_work, r.peaks) for r in prof if r.peaks and r.profile_work],
        )
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
