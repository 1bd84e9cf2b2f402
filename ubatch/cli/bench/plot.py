"""`ubatch bench --plot`: the compute buffer and t/s drawn against the parameter that was swept.

A table of a -ub sweep says the numbers; the plot is there to show the shape (the buffer
halving with -ub, speed falling off at small ubatches, where the time goes). So it must stay
readable for any values: legends sit beside the panels instead of on the lines, labels keep
three significant digits (0.30 t/s is not "0"), and the axes leave room for every label.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ubatch.cli.bench.params import BenchError
from ubatch.cli.bench.result import BenchResult
from ubatch.kernels.profiling import CATEGORIES, CATEGORY_TITLES

# parameters a plot may put on its x axis, in order of preference (as the user asked for them)
X_CANDIDATES = ("n_ubatch", "n_batch", "n_depth", "n_threads", "n_outputs_max")
X_LABELS = {
    "n_ubatch": "-ub (n_ubatch)",
    "n_batch": "-b (n_batch)",
    "n_depth": "-d (depth)",
    "n_threads": "-t (threads)",
    "n_outputs_max": "-nom (n_outputs_max)",
}
SERIES_KEYS = ("n_ubatch", "n_batch", "n_depth", "n_threads", "type_k", "type_v", "n_outputs_max")
SHORT = {
    "n_ubatch": "ub",
    "n_batch": "b",
    "n_depth": "d",
    "n_threads": "t",
    "type_k": "ctk",
    "type_v": "ctv",
    "n_outputs_max": "nom",
}
LABEL_SIZE = 7
Y_MARGIN = 0.15  # headroom above and below the data, so the value labels stay inside the axes


def sig_label(v: float, digits: int = 3) -> str:
    """A value with `digits` significant digits, trailing zeros kept and no exponent:
    0.3 -> '0.300', 17.134 -> '17.1', 892.16 -> '892', 12345.6 -> '12346'."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    rounded = float(f"{v:.{digits}g}")  # 9.996 -> 10.0, so the digits are counted after rounding
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(rounded))))
    return f"{v:.{decimals}f}"


def legend_outside(ax: Axes, **kwargs: Any) -> None:
    """The legend to the right of the axes, top-aligned, so it never covers the data."""
    ax.legend(fontsize=LABEL_SIZE, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


def _label(ax: Axes, x: float, y: float, text: str, below: bool = False, side: int = 0, **kwargs: Any) -> None:
    """A value label just above (or below) a point; side -1/+1 puts it left/right of x."""
    ax.annotate(
        text,
        (x, y),
        fontsize=LABEL_SIZE,
        textcoords="offset points",
        xytext=(4 * side, -11 if below else 5),
        ha=("right", "center", "left")[side + 1],
        **kwargs,
    )


@dataclass(slots=True)
class Sweep:
    """The results and how to read them: each one's parameters as requested, the parameter on
    the x axis (None: no parameter varied) and the other varied ones, which split the lines."""

    results: list[BenchResult]
    req: list[dict[str, Any]]
    x_key: str | None
    series_keys: list[str]

    def name(self, i: int, with_x: bool = False, sep: str = " ") -> str:
        parts = [self.results[i].test] + [f"{SHORT[k]} {self.req[i][k]}" for k in self.series_keys]
        if with_x and self.x_key is not None:
            parts.append(f"{SHORT[self.x_key]} {self.req[i][self.x_key]}")
        return sep.join(parts)

    def groups(self) -> dict[str, list[int]]:
        """One line per name, its points in x order."""
        out: dict[str, list[int]] = {}
        for i in range(len(self.results)):
            out.setdefault(self.name(i), []).append(i)
        if (x := self.x_key) is not None:
            for idx in out.values():
                idx.sort(key=lambda i: self.req[i][x])
        return out


def sweep_of(results: Sequence[BenchResult], tests: Sequence[Any] | None = None) -> Sweep:
    """Each result's parameters as the user gave them (the test instance when known: clamps
    per test, such as n_ubatch <= n_ctx, must not make a parameter look varied)."""
    rs = list(results)
    if tests is not None and len(tests) == len(rs):
        req = [{k: getattr(t, k) for k in SERIES_KEYS} for t in tests]
    else:
        req = [{k: getattr(r, k) for k in SERIES_KEYS} for r in rs]
    varied = [k for k in SERIES_KEYS if len({q[k] for q in req}) > 1]
    x_key = next((k for k in X_CANDIDATES if k in varied), None)
    return Sweep(rs, req, x_key, [k for k in varied if k != x_key])


def _bars(sw: Sweep, ax_mem: Axes, ax_ts: Axes) -> None:
    """No parameter varied: the tests themselves on the x axis."""
    rs = sw.results
    xs = list(range(len(rs)))
    ax_mem.bar([x - 0.2 for x in xs], [r.compute_buffer_mib for r in rs], 0.4, label="compute buffer (reserved)")
    ax_mem.bar([x + 0.2 for x in xs], [r.used_buffer_mib for r in rs], 0.4, label="largest graph that ran")
    ax_ts.bar(xs, [r.avg_ts for r in rs], yerr=[r.stddev_ts for r in rs], capsize=4)
    for x, r in zip(xs, rs):
        _label(ax_ts, x, r.avg_ts + r.stddev_ts, sig_label(r.avg_ts))
    for ax in (ax_mem, ax_ts):
        ax.set_xticks(xs, [sw.name(i, sep="\n") for i in xs], fontsize=LABEL_SIZE)


def _lines(sw: Sweep, ax_mem: Axes, ax_ts: Axes) -> None:
    """One line per test (and other varied parameter) against the swept parameter. With several
    lines the t/s labels alternate left and right of x, so close lines do not stack them."""
    x_key = sw.x_key
    assert x_key is not None
    groups = sw.groups()
    for k, (lab, idx) in enumerate(groups.items()):
        g = [sw.results[i] for i in idx]
        xs = [sw.req[i][x_key] for i in idx]
        line = ax_mem.plot(xs, [r.compute_buffer_mib for r in g], "o-", label=f"{lab}: compute buffer")[0]
        color = line.get_color()
        ax_mem.plot(
            xs, [r.used_buffer_mib for r in g], "s--", color=color, alpha=0.7, label=f"{lab}: largest graph that ran"
        )
        for x, r in zip(xs, g):
            _label(ax_mem, x, r.compute_buffer_mib, sig_label(r.compute_buffer_mib))
            if abs(r.used_buffer_mib - r.compute_buffer_mib) > 0.05 * r.compute_buffer_mib:
                _label(ax_mem, x, r.used_buffer_mib, sig_label(r.used_buffer_mib), below=True, color=color)
        ax_ts.errorbar(
            xs, [r.avg_ts for r in g], yerr=[r.stddev_ts for r in g], fmt="o-", capsize=4, color=color, label=lab
        )
        side = 0 if len(groups) == 1 else (-1 if k % 2 == 0 else 1)
        for x, r in zip(xs, g):
            _label(ax_ts, x, r.avg_ts + r.stddev_ts, sig_label(r.avg_ts), side=side, color=color)
    xvals = sorted({q[x_key] for q in sw.req})
    for ax in (ax_mem, ax_ts):
        if x_key in ("n_ubatch", "n_batch") and min(xvals) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xvals, [str(v) for v in xvals])
        ax.minorticks_off()
        ax.margins(x=0.08)  # room for the labels beside the first and last points
        ax.set_xlabel(X_LABELS[x_key])
    legend_outside(ax_ts)


CAPTION_CHARS = 120  # a caption line at 8 pt across the 10-inch figure


def buffer_caption(results: Sequence[BenchResult]) -> str:
    """Why this buffer dwarfs a chat's at the same -ub: the logits rows it is planned for.
    llama-bench plans one output row per batch row (n_outputs_max = n_batch); a chat plans one
    per sequence, and with a 262k vocabulary 512 rows of logits alone are 512 MiB."""
    if all(r.n_outputs_max == r.n_batch_eff for r in results):
        text = (
            "Larger than a chat's compute buffer at the same -ub: bench reserves logits for every batch row, as "
            "llama-bench (-nom 0: n_outputs_max = n_batch), so the buffer holds min(-ub, n_batch) rows of n_vocab "
            "logits; a chat reserves one row per sequence. -nom N changes bench's."
        )
    else:
        nom = "/".join(map(str, sorted({r.n_outputs_max for r in results})))
        text = (
            f"bench reserved logits for n_outputs_max = {nom} rows (-nom), so its compute buffer holds "
            f"min(-ub, {nom}) rows of n_vocab logits; a chat reserves one row per sequence "
            "(-nom 0: one per batch row, as llama-bench)."
        )
    return textwrap.fill(text, CAPTION_CHARS)


def _memory_axes(sw: Sweep, ax: Axes) -> None:
    rs = sw.results
    kv = {r.kv_mib for r in rs}
    if len(kv) == 1:
        ax.axhline(kv.pop(), color="grey", ls=":", lw=1, label=f"KV cache ({sig_label(rs[0].kv_mib)} MiB)")
    ax.set_ylabel("MiB")
    ax.set_title("compute buffer (reserved worst case; dashed: largest graph that ran)", fontsize=9)
    ax.margins(y=Y_MARGIN)
    mem = [v for r in rs for v in (r.compute_buffer_mib, r.used_buffer_mib, r.kv_mib) if v > 0]
    if mem and max(mem) / min(mem) > 20:  # reserved and used differ by orders of magnitude
        ax.set_yscale("log")
        ax.set_ylabel("MiB (log scale)")
    else:
        ax.set_ylim(bottom=0)
    legend_outside(ax)


def _profile(sw: Sweep, ax: Axes, profiled: list[int]) -> None:
    """Stacked bars: µs per token by op category, one bar per profiled test."""
    rs = sw.results
    pos = list(range(len(profiled)))
    bottom = [0.0] * len(profiled)
    for c in CATEGORIES:
        vals = [1e3 * rs[i].profile_ms.get(c, 0.0) / max(1, rs[i].n_prompt + rs[i].n_gen) for i in profiled]
        ax.bar(pos, vals, 0.6, bottom=bottom, label=CATEGORY_TITLES[c])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(
        pos, [sw.name(i, with_x=True, sep="\n") for i in profiled], fontsize=LABEL_SIZE if len(pos) <= 8 else 6
    )
    ax.set_ylabel("µs per token")
    ax.set_title("where the time goes (op profile)", fontsize=9)
    legend_outside(ax, reverse=True)  # the legend reads top-down like the stack
    ax.grid(alpha=0.3, axis="y")


def build_figure(results: Sequence[BenchResult], tests: Sequence[Any] | None = None) -> Figure:
    """Two panels against the parameter the user varied (-ub first): compute buffer MiB
    (reserved; dashed: the largest graph that ran; dotted: KV) and tokens/s with the stddev as
    error bars, one line per test (and per other varied parameter); a third panel with the op
    profile (µs per token by category) when the run was profiled. With no varied parameter the
    x axis is the tests themselves (bars)."""
    sw = sweep_of(results, tests)
    rs = sw.results
    profiled = [i for i, r in enumerate(rs) if r.profile_ms]
    if (x := sw.x_key) is not None:
        profiled.sort(key=lambda i: (sw.req[i][x], sw.name(i)))
    n_panels = 3 if profiled else 2
    fig = Figure(figsize=(10, 3.4 * n_panels), layout="constrained")
    axes = fig.subplots(n_panels, 1)
    ax_mem, ax_ts = axes[0], axes[1]
    threads = sorted({r.n_threads for r in rs})
    fig.suptitle(
        f"ubatch bench: {rs[0].model_type}, {'/'.join(map(str, threads))} threads ({rs[0].cpu_info})", fontsize=10
    )
    (_bars if sw.x_key is None else _lines)(sw, ax_mem, ax_ts)
    _memory_axes(sw, ax_mem)
    ax_ts.set_ylabel("tokens/s")
    ax_ts.set_title("speed (mean ± stddev over repetitions)", fontsize=9)
    top = max(r.avg_ts + r.stddev_ts for r in rs)
    ax_ts.set_ylim(0, top * (1 + Y_MARGIN) if top > 0 else None)
    for ax in (ax_mem, ax_ts):
        ax.grid(alpha=0.3)
    if profiled:
        _profile(sw, axes[2], profiled)
    fig.supxlabel(buffer_caption(rs), fontsize=8, x=0.01, ha="left", linespacing=1.4)
    return fig


def write_plot(results: Sequence[BenchResult], path: Path, tests: Sequence[Any] | None = None) -> None:
    """`build_figure`, saved to `path` (the format from its extension)."""
    fig = build_figure(results, tests)
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise BenchError(f"--plot {path}: cannot write ({e.strerror})") from None


__all__ = [
    "X_CANDIDATES",
    "SERIES_KEYS",
    "Sweep",
    "sweep_of",
    "sig_label",
    "legend_outside",
    "buffer_caption",
    "build_figure",
    "write_plot",
]
