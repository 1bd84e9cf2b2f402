"""`ubatch bench` / `ubatch batched-bench`: llama-bench's list syntax and test expansion, its
output formats (parsed back), real runs on a tiny model through the Python API and the CLI,
and bad input (one-line errors, exit 1, no traceback)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
from bench_sample import SAMPLE
from cli_inproc import Ran, run_cli

from ubatch.cli.bench.batched import BatchedParams, BatchedResult, n_ctx_required, run_batched_bench
from ubatch.cli.bench.batched_format import batched_md_head, batched_md_row
from ubatch.cli.bench.format import LLAMA_BENCH_FIELDS, format_csv, format_json, format_jsonl, format_md
from ubatch.cli.bench.params import (
    BenchError,
    BenchParams,
    BenchTest,
    check_tests,
    expand,
    int_list,
    pair_list,
    parse_int_range,
    str_list,
)
from ubatch.cli.bench.plot import build_figure, sig_label
from ubatch.cli.bench.profile_format import format_profile_md
from ubatch.cli.bench.result import BenchResult, TensorShare
from ubatch.cli.bench.run import run_bench
from ubatch.cli.bench.target import output_target
from ubatch.engine.gguf.file import open_gguf
from ubatch.engine.kv.cache import KV_TYPES

M = Path("m.gguf")


# -- list syntax ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("512", [512]),
        ("512,256,128,64", [512, 256, 128, 64]),
        ("1-4", [1, 2, 3, 4]),
        ("0-4096+1024", [0, 1024, 2048, 3072, 4096]),
        ("64-512*2", [64, 128, 256, 512]),
        ("64-500*2", [64, 128, 256]),
        ("1-2,16,32-64*2", [1, 2, 16, 32, 64]),
        ("7-7", [7]),
    ],
)
def test_parse_int_range(text: str, expected: list[int]) -> None:
    assert parse_int_range(text, "-ub") == expected


@pytest.mark.parametrize("text", ["", "a", "512-", "-5", "1-4+0", "0-8*2", "4-8*1", "512-64", "1,,2", "1-4/2", "1.5"])
def test_parse_int_range_rejects(text: str) -> None:
    with pytest.raises(BenchError, match="-ub"):
        parse_int_range(text, "-ub")


def test_lists_concatenate_and_replace_defaults() -> None:
    assert int_list(None, [512], "-p") == [512]
    assert int_list(["512", "256,128"], [512], "-ub") == [512, 256, 128]  # repeated flags
    assert str_list(["f16,q8_0", "q4_0"], ["f16"], "-ctk", KV_TYPES) == ["f16", "q8_0", "q4_0"]
    with pytest.raises(BenchError, match="-ctk: unknown value 'q9'"):
        str_list(["q9"], ["f16"], "-ctk", KV_TYPES)
    assert pair_list(["512,128", "64,16"]) == [(512, 128), (64, 16)]
    with pytest.raises(BenchError, match="-pg"):
        pair_list(["512"])


# -- expansion ------------------------------------------------------------------------------------


def test_expand_reference_example() -> None:
    """-p 512 -n 128 -ub 512,256,128 -> 6 tests: ub512 pp512, ub512 tg128, ub256 pp512, ..."""
    tests = expand(BenchParams(models=[M], n_ubatch=[512, 256, 128]))
    assert [(t.n_ubatch, t.name) for t in tests] == [
        (512, "pp512"),
        (512, "tg128"),
        (256, "pp512"),
        (256, "tg128"),
        (128, "pp512"),
        (128, "tg128"),
    ]


def test_expand_cross_product_order_and_names() -> None:
    p = BenchParams(
        models=[M],
        n_prompt=[0, 64],
        n_gen=[0, 16],
        n_pg=[(32, 8), (0, 0)],
        n_depth=[0, 256],
        n_batch=[128, 256],
        n_ubatch=[32, 64],
        type_k=["f16", "q8_0"],
    )
    tests = expand(p)
    # 2 b x 2 ub x 2 ctk x 2 d, each with pp64, tg16, pp32+tg8 (zeros skipped)
    assert len(tests) == 2 * 2 * 2 * 2 * 3
    assert [t.name for t in tests[:6]] == ["pp64", "tg16", "pp32+tg8", "pp64 @ d256", "tg16 @ d256", "pp32+tg8 @ d256"]
    # n_batch is the outermost parameter, then n_ubatch, then type_k, then depth
    assert [t.n_batch for t in tests] == [128] * 24 + [256] * 24
    assert [t.n_ubatch for t in tests[:24]] == [32] * 12 + [64] * 12
    assert [t.type_k for t in tests[:12]] == ["f16"] * 6 + ["q8_0"] * 6
    t = tests[4]
    assert (t.n_prompt, t.n_gen, t.n_depth, t.n_ctx) == (0, 16, 256, 272)
    cp = t.context_params()
    assert (cp.n_ctx, cp.n_batch, cp.n_ubatch) == (272, 128, 32)


def test_depth_beyond_context_is_refused() -> None:
    tests = expand(BenchParams(models=[M], n_prompt=[512], n_gen=[0], n_depth=[0, 4096]))
    check_tests(tests[:1], {M: 2048})
    with pytest.raises(BenchError, match=r"pp512 @ d4096 needs a context of 4608 tokens.*2048"):
        check_tests(tests, {M: 2048})
    with pytest.raises(BenchError, match="nothing to run"):
        check_tests(expand(BenchParams(models=[M], n_prompt=[0], n_gen=[0])), {M: 2048})


# -- formats --------------------------------------------------------------------------------------


def _result(test: BenchTest, ts: list[float], ub_eff: int | None = None) -> BenchResult:
    ns = [int(1e9 * (test.n_prompt + test.n_gen) / x) for x in ts]
    return replace(
        SAMPLE,
        n_batch=test.n_batch,
        n_ubatch=test.n_ubatch,
        type_k=test.type_k,
        type_v=test.type_v,
        n_prompt=test.n_prompt,
        n_gen=test.n_gen,
        n_depth=test.n_depth,
        avg_ns=sum(ns) // len(ns),
        stddev_ns=1,
        avg_ts=sum(ts) / len(ts),
        stddev_ts=1.5,
        samples_ns=ns,
        samples_ts=ts,
        test=test.name,
        n_ubatch_eff=ub_eff or test.n_ubatch,
        compute_buffer_mib=12.5,
        used_buffer_mib=10.0,
        buffer_top=[TensorShare("ffn_gate-0", (512, 2048), 4.0)],
        used_top=[TensorShare("ffn_up-0", (512, 2048), 4.0)],
        profile_ms={"matmul": 10.0, "overhead": 2.0},
    )


@pytest.fixture
def synthetic() -> tuple[BenchParams, list[BenchResult]]:
    p = BenchParams(models=[M], n_ubatch=[512, 64])
    rs = [
        _result(t, [100.0 + i, 102.0 + i], ub_eff=128 if t.n_gen and t.n_ubatch == 512 else None)
        for i, t in enumerate(expand(p))
    ]
    return p, rs


def _md_rows(text: str) -> list[dict[str, str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "").split()) <= {"-" * n + s for n in range(1, 40) for s in ("", ":")}
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def test_md_has_llama_bench_columns(synthetic) -> None:  # noqa: ANN001
    p, rs = synthetic
    text = format_md(p, rs)
    head = text.splitlines()[0]
    # llama-bench's header (CPU backend, -ub list), then ubatch's columns
    assert head.startswith(
        "| model                          |       size |     params | backend    | threads | n_ubatch |            test |                  t/s |"
    )
    rows = _md_rows(text)
    assert [r["test"] for r in rows] == ["pp512", "tg128", "pp512", "tg128"]
    assert [r["n_ubatch"] for r in rows] == ["512", "512", "64", "64"]
    assert rows[0]["model"] == "gemma3 270M Q4_K - Medium"
    assert rows[0]["size"] == "241.28 MiB" and rows[0]["params"] == "268.10 M"
    assert rows[0]["t/s"] == "101.00 ± 1.50"
    tg = rs[1]  # generation reads every matrix once per token: bytes x t/s
    assert rows[0]["GB/s"] == "-" and rows[1]["GB/s"] == f"{tg.model_size * tg.avg_ts / 1e9:.2f}"
    assert rows[1]["ub_eff"] == "128"  # the clamp is shown
    assert (rows[0]["buffer MiB"], rows[0]["used MiB"], rows[0]["KV MiB"]) == ("12.50", "10.00", "6.00")
    assert text.rstrip().endswith("build: 0.1.0 (0)")
    # defaults only: no n_ubatch column, no ub_eff column when nothing was clamped
    p1 = BenchParams(models=[M], n_gen=[0])
    text1 = format_md(p1, [_result(t, [5.0]) for t in expand(p1)])
    assert "n_ubatch" not in text1.splitlines()[0] and "ub_eff" not in text1


def test_csv_json_jsonl_parse_back(synthetic) -> None:  # noqa: ANN001
    _, rs = synthetic
    rows = list(csv.DictReader(io.StringIO(format_csv(rs))))
    assert len(rows) == 4 and set(LLAMA_BENCH_FIELDS) <= set(rows[0])
    assert [r["test"] for r in rows] == ["pp512", "tg128", "pp512", "tg128"]
    assert float(rows[0]["avg_ts"]) == pytest.approx(101.0) and rows[0]["n_ubatch"] == "512"
    assert rows[0]["compute_buffer_mib"] == "12.5" and rows[0]["profile_matmul_ms"] == "10.0"
    assert format_csv(rs).splitlines()[1].startswith('"0.1.0","0",')  # every value quoted, as llama-bench
    for objs in (json.loads(format_json(rs)), [json.loads(line) for line in format_jsonl(rs).splitlines()]):
        assert len(objs) == 4
        o = objs[2]
        assert set(LLAMA_BENCH_FIELDS) <= set(o) and {"samples_ns", "samples_ts"} <= set(o)
        assert (o["n_ubatch"], o["n_prompt"], o["n_gen"], o["compute_buffer_mib"], o["kv_mib"]) == (
            64,
            512,
            0,
            12.5,
            6.0,
        )
        assert o["samples_ts"] == [102.0, 104.0] and isinstance(o["avg_ns"], int)
        assert o["buffer_top"][0] == {"name": "ffn_gate-0", "shape": [512, 2048], "mib": 4.0}
    assert "Python/graph" in format_profile_md(rs)


def test_output_target() -> None:
    assert output_target("json") == ("json", None)
    assert output_target("out.jsonl") == ("jsonl", Path("out.jsonl"))
    with pytest.raises(BenchError, match="-o 'sql'"):
        output_target("sql")
    with pytest.raises(BenchError, match="does not exist"):
        output_target("/nonexistent-dir/x.csv")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_read_only_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(BenchError, match="is not writable"):
            output_target(str(ro / "x.json"))
    finally:
        ro.chmod(0o700)


def test_batched_bench_table_columns() -> None:
    head = batched_md_head().splitlines()
    assert [c.strip() for c in head[0].strip("|").split("|")] == [
        "PP",
        "TG",
        "B",
        "N_KV",
        "T_PP s",
        "S_PP t/s",
        "T_TG s",
        "S_TG t/s",
        "T s",
        "S t/s",
    ]
    assert (
        head[0]
        == "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
    )
    assert (
        head[1]
        == "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|"
    )
    row = batched_md_row(BatchedResult(128, 128, 4, 1024, 0.5, 1024.0, 2.0, 256.0, 2.5, 409.6))
    assert (
        row == "|   128 |    128 |    4 |   1024 |    0.500 |  1024.00 |    2.000 |   256.00 |    2.500 |   409.60 |\n"
    )
    # N_KV as llama-batched-bench computes it (reference: -npp 128 -ntg 128 -npl 1,2,4 -> 256, 512, 1024)
    assert [n_ctx_required(128, 128, pl, False, False) for pl in (1, 2, 4)] == [256, 512, 1024]
    assert n_ctx_required(128, 128, 4, True, False) == 4 * 128 + 4 * 128
    assert n_ctx_required(128, 128, 4, True, True) == 128 + 4 * 128


# -- real runs on a tiny model ---------------------------------------------------------------------


def test_python_api_run_is_sane(tiny_gemma: Path) -> None:
    events = []
    p = BenchParams(
        models=[tiny_gemma],
        n_prompt=[64],
        n_gen=[8],
        n_pg=[(16, 4)],
        n_depth=[0, 32],
        n_ubatch=[64, 16],
        n_threads=[1],
        reps=2,
        profile=True,
    )
    rs = run_bench(p, events.append)
    assert [r.test for r in rs[:3]] == ["pp64", "tg8", "pp16+tg4"] and len(rs) == 12
    assert [(e.test_index, e.rep) for e in events if e.kind == "rep"][:2] == [(1, 1), (1, 2)]
    for r in rs:
        assert r.avg_ts > 0 and r.avg_ns > 0 and len(r.samples_ns) == 2 and r.stddev_ts >= 0
        assert r.compute_buffer_mib > 0 and r.kv_mib > 0 and r.used_buffer_mib > 0
        assert r.n_ctx % 256 == 0 and r.n_ubatch_eff == min(r.n_ubatch, r.n_batch_eff)
        assert sum(r.profile_ms.values()) == pytest.approx(r.avg_ns / 1e6, rel=0.02)
        assert r.profile_ms["matmul"] > 0 and r.profile_ms["attention"] > 0
        assert r.buffer_top and r.buffer_top[0].mib >= r.buffer_top[-1].mib
    by = {(r.test, r.n_ubatch): r for r in rs}
    for ub in (64, 16):
        pp, tg = by[("pp64", ub)], by[("tg8", ub)]
        assert pp.avg_ts >= tg.avg_ts  # a prompt token is cheaper than a generated one
        assert pp.n_ubatches == 64 // ub and tg.n_ubatches == 8
    # a smaller ubatch plans a smaller compute buffer; the KV cache does not care
    assert by[("pp64", 16)].compute_buffer_mib < by[("pp64", 64)].compute_buffer_mib
    assert by[("pp64 @ d32", 16)].n_depth == 32


def test_batched_bench_api(tiny_gemma: Path) -> None:
    header, rows = run_batched_bench(
        BatchedParams(model=tiny_gemma, n_ctx=1024, n_threads=1, n_pp=[32], n_tg=[4], n_pl=[1, 2, 4])
    )
    assert [(r.pl, r.n_kv) for r in rows] == [(1, 36), (2, 72), (4, 144)]
    assert header.n_kv_max == 1024 and header.compute_buffer_mib > 0
    for r in rows:
        assert r.t == pytest.approx(r.t_pp + r.t_tg)
        assert r.speed_pp == pytest.approx(r.pl * r.pp / r.t_pp)
        assert r.speed == pytest.approx(r.pl * (r.pp + r.tg) / r.t)
    _, shared = run_batched_bench(
        BatchedParams(model=tiny_gemma, n_ctx=1024, n_threads=1, n_pp=[32], n_tg=[2], n_pl=[2], pps=True)
    )
    assert shared[0].n_kv == 2 * 32 + 2 * 2
    assert shared[0].speed_pp == pytest.approx(32 / shared[0].t_pp)


# -- the CLI ----------------------------------------------------------------------------------------


def ubatch(*args: object) -> Ran:
    """`ubatch ARGS` through the real CLI in this process (tests/cli_inproc.py): a fresh process
    would spend seconds importing torch for a tiny model's milliseconds."""
    return run_cli([str(a) for a in args], {"COLUMNS": "200"})


@pytest.fixture(scope="module")
def runs(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    (tmp / "afile").write_text("")
    m = tiny_gemma
    cmds = {
        "json": ["bench", "-m", m, "-p", "16", "-n", "4", "-r", "2", "-t", "1", "-o", "json"],
        "md": [
            "bench",
            "-m",
            m,
            "-p",
            "32",
            "-n",
            "0",
            "-ub",
            "32,16",
            "-b",
            "16",
            "-r",
            "1",
            "-t",
            "1",
            "--profile",
            "--plot",
            tmp / "sweep.png",
            "-o",
            tmp / "out.csv",
        ],
        "sweep": [
            "bench",
            "-m",
            m,
            "-p",
            "16",
            "--sweep-ub",
            "4-16*2",
            "-r",
            "1",
            "-t",
            "1",
            "--plot",
            tmp / "ub.svg",
            "-o",
            "jsonl",
        ],
        "batched": ["batched-bench", "-m", m, "-c", "512", "-npp", "16", "-ntg", "4", "-npl", "1,2", "-t", "1"],
        "batched_jsonl": [
            "batched-bench",
            "-m",
            m,
            "-c",
            "512",
            "-npp",
            "16",
            "-ntg",
            "2",
            "-npl",
            "2",
            "-t",
            "1",
            "--output-format",
            "jsonl",
        ],
        "batched_profile": ["batched-bench", "-m", m, "-c", "512", "-npp", "8", "-ntg", "4", "-npl", "1,3"]
        + ["-t", "1", "--profile"],
        "batched_profile_jsonl": ["batched-bench", "-m", m, "-c", "512", "-npp", "8", "-ntg", "2", "-npl", "2"]
        + ["-t", "1", "--profile", "--output-format", "jsonl"],
        "depth": ["bench", "-m", m, "-p", "16", "-n", "0", "-d", "4096", "-r", "1"],
        "bad_out": ["bench", "-m", m, "-p", "16", "-n", "0", "-r", "1", "-o", tmp / "nodir" / "x.json"],
        "bad_plot_dir": ["bench", "-m", m, "-p", "16", "-n", "0", "-r", "1", "--plot", tmp / "afile" / "x.png"],
        "bad_plot": ["bench", "-m", m, "-r", "1", "--plot", tmp / "x.txt"],
        "bad_range": ["bench", "-m", m, "-ub", "512-64"],
        "no_model": ["bench", "-m", tmp / "missing.gguf"],
    }
    out: dict = {name: ubatch(*args) for name, args in cmds.items()}
    out["tmp"] = tmp
    out["model"] = m
    return out


def test_cli_json(runs: dict) -> None:
    r = runs["json"]
    assert r.returncode == 0, r.stderr
    objs = json.loads(r.stdout)
    assert [o["n_prompt"] for o in objs] == [16, 0] and [o["n_gen"] for o in objs] == [0, 4]
    for o in objs:
        assert set(LLAMA_BENCH_FIELDS) <= set(o) and len(o["samples_ns"]) == 2
        assert o["avg_ts"] > 0 and o["compute_buffer_mib"] > 0 and o["kv_mib"] > 0
    assert objs[0]["avg_ts"] >= objs[1]["avg_ts"]


def test_cli_csv_file_profile_and_plot(runs: dict) -> None:
    r, tmp = runs["md"], runs["tmp"]
    assert r.returncode == 0, r.stderr
    # -ub 32 > -b 16 is clamped as llama.cpp does, and said
    assert "-ub 32 > -b 16: n_ubatch is clamped to 16" in r.stderr
    rows = list(csv.DictReader((tmp / "out.csv").open()))
    assert [(x["n_ubatch"], x["n_ubatch_eff"]) for x in rows] == [("32", "16"), ("16", "16")]
    assert all(float(x["profile_matmul_ms"]) > 0 for x in rows)
    assert (tmp / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_sweep_ub(runs: dict) -> None:
    r, tmp = runs["sweep"], runs["tmp"]
    assert r.returncode == 0, r.stderr
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(o["test"], o["n_ubatch"]) for o in objs] == [("pp16", 4), ("pp16", 8), ("pp16", 16)]  # -n 0
    assert objs[0]["compute_buffer_mib"] < objs[2]["compute_buffer_mib"]
    assert (tmp / "ub.svg").read_text().lstrip().startswith("<?xml")


def test_cli_batched_bench(runs: dict) -> None:
    r = runs["batched"]
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.startswith("llama_batched_bench: n_kv_max = 512, n_batch = 512, n_ubatch = 512,") for ln in lines)
    rows = [ln for ln in lines if ln.startswith("|") and ln[1:7].strip().isdigit()]
    assert [int(x.split("|")[3]) for x in rows] == [1, 2]
    assert [int(x.split("|")[4]) for x in rows] == [20, 40]
    assert all(float(x.split("|")[10]) > 0 for x in rows)
    js = [json.loads(ln) for ln in runs["batched_jsonl"].stdout.splitlines()]
    assert len(js) == 1 and js[0]["pl"] == 2 and js[0]["n_kv"] == 36 and js[0]["speed"] > 0
    assert {"t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed", "n_kv_max"} <= set(js[0])
    assert "profile_ms" not in js[0]  # only on request


def test_cli_batched_bench_profile(runs: dict) -> None:
    """--profile: after llama's table, one row per combination saying where a generation step
    went; the categories and the rest add up to the step time the table implies."""
    r = runs["batched_profile"]
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "where a generation step's time goes" in text
    rows = [ln.split("|")[1:-1] for ln in text.splitlines() if ln.startswith("|")]
    table = [x for x in rows if len(x) == 10 and x[0].strip().isdigit()]
    prof = [x for x in rows if len(x) == 14 and x[0].strip().isdigit()]
    assert [int(x[2]) for x in table] == [1, 3] and [int(x[2]) for x in prof] == [1, 3]
    for t, p in zip(table, prof, strict=True):
        step_ms = 1e3 * float(t[6]) / int(t[1])  # T_TG s / TG, T_TG printed to the millisecond
        parts = [float(c.split()[0]) for c in p[4:]]
        assert float(p[3]) == pytest.approx(sum(parts), abs=0.06)  # ten cells rounded to 0.01
        assert float(p[3]) == pytest.approx(step_ms, rel=0.05, abs=0.5 / int(t[1]) + 0.02)
        assert parts[0] > 0  # the layers' matmuls (the tiny model's head rounds to 0.00 ms here)
    # then the products and attention against the CPU's peaks, measured in the same process
    assert "against this machine's peaks (measured beside the run; 1 threads" in text
    peak_rows = [x for x in rows if len(x) == 12 and x[0].strip().isdigit()]
    assert {(int(x[2]), x[3].strip()) for x in peak_rows} >= {(1, "matmul (layers)"), (3, "matmul (output)")}
    for x in peak_rows:
        gflops, of_fma, gbs = float(x[5]), float(x[6].strip().rstrip("%")), float(x[9])
        assert gflops > 0 and gbs > 0 and of_fma >= 0 and x[11].strip() in ("memory", "compute")
    js = [json.loads(ln) for ln in runs["batched_profile_jsonl"].stdout.splitlines()]
    assert len(js) == 1 and js[0]["pl"] == 2
    prof_ms = js[0]["profile_ms"]
    assert prof_ms["matmul"] > 0 and prof_ms["lm_head"] > 0 and "overhead" in prof_ms
    assert sum(prof_ms.values()) == pytest.approx(1e3 * js[0]["t_tg"] / 2, rel=0.05)
    # a step of 2 sequences: 2 x 2 n k flops over every layer matrix, each read once
    g = open_gguf(runs["model"])
    mats = [t for name, t in g.tensors.items() if name.startswith("blk.") and len(t.shape) == 2]
    work = js[0]["profile_work"]
    assert work["matmul"]["flops"] == 2 * 2 * sum(t.shape[0] * t.shape[1] for t in mats)
    assert work["matmul"]["bytes"] == sum(t.n_bytes for t in mats)
    assert work["lm_head"]["flops"] == 2 * 2 * math.prod(g.tensors["token_embd.weight"].shape)
    peaks = js[0]["peaks"]
    assert peaks["n_threads"] == 1 and min(peaks[k] for k in ("fma_flops", "dot16_ops", "dot8_ops", "read_bytes")) > 0


@pytest.mark.parametrize(
    "name,message",
    [
        ("depth", "needs a context of 4112 tokens"),
        ("bad_out", "nodir does not exist"),
        ("bad_plot_dir", "afile is not a directory"),
        ("bad_plot", "use a .png"),
        ("bad_range", "range '512-64' is empty"),
        ("no_model", "model file not found"),
    ],
)
def test_cli_bad_input(runs: dict, name: str, message: str) -> None:
    r = runs[name]
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- the plot -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,label",
    [
        (0.3, "0.300"),
        (0.0304, "0.0304"),
        (1.5, "1.50"),
        (17.134, "17.1"),
        (9.996, "10.0"),
        (892.16, "892"),
        (12345.6, "12346"),
        (0.0, "0"),
    ],
)
def test_plot_labels_keep_significant_digits(value: float, label: str) -> None:
    assert sig_label(value) == label


def test_plot_legends_sit_outside_the_data(synthetic) -> None:  # noqa: ANN001
    """Tiny speeds get readable labels, and no legend overlaps its panel's data area."""
    p, rs = synthetic
    for r in rs:
        r.avg_ts, r.stddev_ts = r.avg_ts / 300, 0.01  # ~0.3 t/s
    fig = build_figure(rs, expand(p))
    fig.draw_without_rendering()
    texts = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {sig_label(r.avg_ts) for r in rs} <= texts and "0.340" in texts
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 3  # buffer, speed, profile
    for ax, leg in legends:
        box, area = leg.get_window_extent(), ax.get_window_extent()
        assert box.x0 >= area.x1, (box, area)
        assert fig.bbox.contains(box.x1 - 1, box.y0 + 1), "legend cut off by the figure edge"
