"""`ubatch bench` says how far its figures can be trusted: each t/s as llama-bench's
`avg ± stddev`, one caution line when some test's repetitions disagree by more than 10% (a busy
machine), and a plot caption saying why bench's compute buffer is larger than a chat's. The
formatting is checked on synthetic results; one real run checks the ± and the caution together."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from bench_sample import SAMPLE
from cli_inproc import run_cli

from ubatch.cli.bench.format import BUSY_SPREAD, busy_line, format_md, spread
from ubatch.cli.bench.params import BenchParams, expand
from ubatch.cli.bench.plot import buffer_caption, build_figure
from ubatch.cli.bench.result import BenchResult

M = Path("m.gguf")


def result(ts: list[float], **kw: object) -> BenchResult:
    """A result whose mean and stddev come from its samples, as run_bench computes them."""
    sd = statistics.stdev(ts) if len(ts) > 1 else 0.0
    return replace(SAMPLE, samples_ts=ts, avg_ts=statistics.fmean(ts), stddev_ts=sd, **kw)  # type: ignore[arg-type]  # kw: any of its fields


def t_s_cells(md: str) -> list[str]:
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    col = [c.strip() for c in lines[0].strip("|").split("|")].index("t/s")
    return [ln.strip("|").split("|")[col].strip() for ln in lines[2:]]


def test_md_shows_every_figure_as_avg_plus_minus_stddev() -> None:
    p = BenchParams(models=[M], n_ubatch=[512, 64])
    rs = [
        result([100.0 + i, 110.0 + i], test=t.name, n_prompt=t.n_prompt, n_gen=t.n_gen) for i, t in enumerate(expand(p))
    ]
    assert t_s_cells(format_md(p, rs)) == [f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}" for r in rs]
    assert t_s_cells(format_md(p, rs))[0] == "105.00 ± 7.07"


@pytest.mark.parametrize(
    "ts,busy",
    [
        ([100.0, 110.0], False),  # 10 / 105 = 9.5%: a quiet machine's jitter
        ([100.0, 111.5], True),  # 11.5 / 105.75 = 10.9%
        ([100.0, 101.0, 100.0, 99.0, 100.0], False),
        ([100.0, 100.0, 100.0, 100.0, 160.0], True),  # one fast outlier: the median stays 100
        ([100.0], False),  # one repetition: nothing to compare
    ],
)
def test_caution_line_appears_only_past_the_threshold(ts: list[float], busy: bool) -> None:
    quiet = result([50.0, 50.5], test="tg128")
    line = busy_line([quiet, result(ts)])
    assert (spread(result(ts)) > BUSY_SPREAD) == busy
    if not busy:
        assert line is None
    else:
        pct = round(100 * (max(ts) - min(ts)) / statistics.median(ts))
        assert line == (
            f"the machine is busy: t/s varied by {pct}% across repetitions (most in pp512); compare ratios from one run"
        )
        assert busy_line([quiet, result(ts)], ["tg128, ub 512", "pp512, ub 64"]) == line.replace(
            "pp512", "pp512, ub 64"
        )
    assert busy_line([]) is None


def test_the_plot_caption_says_why_the_buffer_is_larger_than_a_chats() -> None:
    rs = [result([10.0, 10.2], n_ubatch=ub, n_ubatch_eff=ub) for ub in (512, 64)]
    default = buffer_caption(rs)
    one_line = " ".join(default.split())
    assert "every batch row, as llama-bench" in one_line and "a chat reserves one row per sequence" in one_line
    assert "-nom N changes bench's" in one_line and max(len(x) for x in default.splitlines()) <= 120
    nom = " ".join(buffer_caption([replace(r, n_outputs_max=1) for r in rs]).split())
    assert "n_outputs_max = 1 rows (-nom)" in nom and "min(-ub, 1)" in nom
    fig = build_figure(rs)
    assert fig.get_supxlabel() == default


def test_a_real_run_prints_plus_minus_and_the_caution_agrees_with_its_samples(tiny_gemma: Path) -> None:
    """-oe json beside the markdown gives the samples the caution is computed from."""
    r = run_cli(["bench", "-m", str(tiny_gemma), "-p", "16", "-n", "2", "-r", "2", "-t", "1", "-oe", "json"])
    assert r.returncode == 0, r.stderr
    cells = t_s_cells(r.stdout)
    assert len(cells) == 2 and all(re.fullmatch(r"\d+\.\d\d ± \d+\.\d\d", c) for c in cells), cells
    start, end = r.stderr.index("[\n"), r.stderr.index("\n]\n") + 2
    objs = json.loads(r.stderr[start:end])
    worst = max((max(o["samples_ts"]) - min(o["samples_ts"])) / statistics.median(o["samples_ts"]) for o in objs)
    assert ("the machine is busy: t/s varied by" in r.stderr) == (worst > BUSY_SPREAD)
