"""`ubatch explain`: the essay's examples come out of the real CLI's --json as the essay states
them, the mask's reasons agree exactly with the mask the engine builds, bad input is one line
naming the flag, and the rendered view fits 100 columns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_inproc import run_cli

from ubatch.engine.batch import Batch, RowKind
from ubatch.engine.context.context import Context
from ubatch.engine.explain.mask import EMPTY, FUTURE, OTHER_SEQ, VISIBLE, WINDOW, classify
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams


@pytest.fixture(scope="module")
def tiny_8k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny gemma3 with a training context long enough for a 5000-token prompt."""
    from tiny_models import TinySpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-8k.gguf", TinySpec(n_ctx_train=8192))


def explain_json(model: Path, *args: str) -> dict[str, Any]:
    r = run_cli(["explain", "-m", str(model), "--temp", "0", "--json", *args])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def a_prompt(n_tokens: int) -> str:
    """Text the tiny vocabulary reads as n_tokens tokens: <bos>, '▁a', then one 'a' each."""
    return "a" * (n_tokens - 1)


def test_a_5000_token_prompt_at_b2048_ub512_is_3_decode_calls_and_10_ubatches(tiny_8k: Path) -> None:
    d = explain_json(tiny_8k, "-p", a_prompt(5000), "-b", "2048", "-ub", "512", "-n", "1")
    assert d["sequences"][0]["n_prompt"] == 5000
    assert (d["n_decode"], d["n_ubatch"]) == (3, 10)
    assert [c["n_tokens"] for c in d["calls"]] == [2048, 2048, 904]
    assert [len(c["ubatches"]) for c in d["calls"]] == [4, 4, 2]
    assert [u["n_tokens"] for u in d["calls"][2]["ubatches"]] == [512, 392]
    # the what-if replays the same calls: at the given -ub it needs exactly the passes that ran
    passes = {w["n_ubatch"]: w["n_passes"] for w in d["what_if"]}
    assert passes == {512: 10, 256: 20, 128: 40, 64: 79}
    compute = [w["compute_bytes"] for w in d["what_if"]]
    assert compute == sorted(compute, reverse=True) and compute[0] == d["memory"]["compute_bytes"]


def test_b64_ub512_runs_with_n_ubatch_64_and_says_which_rule_fired(tiny_gemma: Path) -> None:
    d = explain_json(tiny_gemma, "-p", a_prompt(100), "-b", "64", "-ub", "512", "-n", "1")
    assert d["effective"]["n_ubatch"] == 64 and d["effective"]["n_batch"] == 64
    step = next(s for s in d["derivation"] if s["name"] == "n_ubatch")
    assert (step["given"], step["value"]) == (512, 64) and step["rule"].startswith("n_batch = 64")
    assert [c["n_tokens"] for c in d["calls"]] == [64, 36]
    ub512 = next(w for w in d["what_if"] if w["n_ubatch_asked"] == 512)
    assert ub512["n_ubatch"] == 64 and "n_batch = 64" in ub512["rule"]
    r = run_cli(["explain", "-m", str(tiny_gemma), "-p", "hello", "-b", "64", "-n", "1"], env={"COLUMNS": "100"})
    assert r.returncode == 0 and "n_ubatch 512 -> 64 because n_batch = 64" in r.stdout


def test_700_used_cells_attend_over_n_kv_768(tiny_llama: Path) -> None:
    d = explain_json(tiny_llama, "-p", a_prompt(700), "-n", "1")
    last = d["calls"][0]["ubatches"][-1]
    kv = last["kv"][0]
    assert (last["n_tokens"], kv["used_max_p1"], kv["n_kv"], kv["pad"]) == (188, 700, 768, 68)
    first = d["calls"][0]["ubatches"][0]["kv"][0]
    assert (first["used_max_p1"], first["n_kv"]) == (512, 512)


@pytest.mark.parametrize("unified", [True, False])
def test_two_sequences_decoded_together_share_ubatches(tiny_gemma: Path, unified: bool) -> None:
    args = ["-p", "hello world", "-p", "the", "-n", "3", "-c", "1024", *(["-kvu"] if unified else [])]
    d = explain_json(tiny_gemma, *args)
    assert d["effective"]["n_seq_max"] == 2 and d["effective"]["kv_unified"] is unified
    ubs = [u for c in d["calls"] for u in c["ubatches"]]
    both = [u for u in ubs if {s for row in u["row_seq"] for s in row} == {0, 1}]
    assert len(both) == 3 and both[-1]["reused"]  # the prompts together, then one row of each per step
    assert all(u["rows_by_seq"] == {"0": {"g": 1}, "1": {"g": 1}} for u in both[1:])
    if unified:  # split_simple: the batch's rows in order
        assert len(ubs) == 3 and both[0]["rows_by_seq"] == {"0": {"p": 4}, "1": {"p": 3}}
    else:  # split_equal: as many rows of each sequence per ubatch, the rest after
        assert len(ubs) == 4 and both[0]["rows_by_seq"] == {"0": {"p": 3}, "1": {"p": 3}}
        assert both[0]["n_seqs"] == 2 and ubs[1]["rows_by_seq"] == {"0": {"p": 1}}
    mask = d["mask"]
    assert mask["ubatch"] == 0
    codes = np.array(mask["caches"][0]["codes"])
    if unified:  # one stream: the other sequence's cells are there, and hidden
        assert (codes == OTHER_SEQ).any() and codes.shape == (1, 7, 7)
    else:  # a stream per sequence: each group sees only its own cells
        assert not (codes == OTHER_SEQ).any() and mask["caches"][0]["streams"] == [0, 1]


@pytest.mark.parametrize("unified", [True, False])
def test_the_mask_reasons_agree_exactly_with_the_engine_mask(tiny_gemma_model: Model, unified: bool) -> None:
    """Every ubatch of two sequences decoding together, both caches of the iSWA pair."""
    params = ContextParams(n_ctx=512, n_seq_max=2, n_outputs_max=2, n_ubatch=8, kv_unified=unified)
    ctx = Context(tiny_gemma_model, params)
    seen: set[int] = set()

    def check(batch: Batch, ub: Any, rec: Any) -> None:
        for c, n_kv in zip(ctx.memory.caches, rec.n_kv):
            streams = c.ubatch_streams(ub)
            codes = classify(c, ub, streams, n_kv)
            assert np.array_equal(codes == VISIBLE, c.mask(ub, streams, n_kv) == 0)
            seen.update(np.unique(codes).tolist())

    ctx.observers.append(check)
    b = Batch()
    for i in range(20):  # longer than the window (n_swa 8)
        b.add(7 + i, i, 0, i == 19)
    for i in range(12):
        b.add(40 + i, i, 1, i == 11)
    ctx.decode(b)
    for k in range(3):
        b = Batch()
        b.add(60 + k, 20 + k, 0, True, RowKind.GENERATED)
        b.add(70 + k, 12 + k, 1, True, RowKind.GENERATED)
        ctx.decode(b)
    assert seen == ({VISIBLE, EMPTY, OTHER_SEQ, FUTURE, WINDOW} if unified else {VISIBLE, EMPTY, FUTURE, WINDOW})


def one_line_error(r: Any) -> str:
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_a_prompt_longer_than_the_context_says_which_flag_to_raise(tiny_gemma: Path) -> None:
    r = run_cli(["explain", "-m", str(tiny_gemma), "-c", "256", "-p", a_prompt(300)])
    line = one_line_error(r)
    assert "prompt 1 has 300 tokens" in line and "raise -c" in line
    r = run_cli(["explain", "-m", str(tiny_gemma), "-c", "512", "-p", "hi", "-p", a_prompt(300)])
    line = one_line_error(r)
    assert "prompt 2 has 300 tokens" in line and "-kvu" in line and "raise -c" in line


@pytest.mark.parametrize(("args", "flag"), [(["-b", "0"], "-b"), (["-np", "0"], "-np"), ([], "-p")])
def test_flags_that_make_no_ubatch_possible_name_the_flag(tiny_gemma: Path, args: list[str], flag: str) -> None:
    prompt = ["-p", "hello"] if flag != "-p" else []
    line = one_line_error(run_cli(["explain", "-m", str(tiny_gemma), *prompt, *args]))
    assert flag in line


def test_the_rendered_view_fits_100_columns(tiny_gemma: Path) -> None:
    args = ["explain", "-m", str(tiny_gemma), "-p", "hello world", "-p", "the", "-n", "3", "-c", "1024", "-kvu"]
    r = run_cli([*args, "--temp", "0"], env={"COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(x) for x in lines) <= 100
    text = r.stdout
    for needle in (
        "n_batch 2048 -> 1024 because n_ctx = 1024",
        "3 decode calls, 3 ubatches",
        "s0:4p s1:3p",
        "256 = 7+249",
        "mask of ubatch 1",
        "memory plan",
        "what if -ub",
    ):
        assert needle in text, needle
    grid = [x for x in lines if x.startswith("  s1 pos 2")]
    assert grid and grid[0].rstrip().endswith("oooo###")


def test_a_5_token_draft_under_ub4_takes_2_passes(tiny_gemma: Path) -> None:
    """The tiny model repeats its last token, so after "...z" it samples z, and ngram-simple finds
    the earlier "zz" followed by five tokens: a 5-token draft, 6 rows with the sampled one."""
    spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "5"]
    d = explain_json(tiny_gemma, "-p", "zzbcdfgjmqrz", "-n", "8", "-ub", "4", "-c", "512", *spec)
    drafted = [c for c in d["calls"] if c["row_kind"] == "gddddd"]
    assert drafted and all([u["n_tokens"] for u in c["ubatches"]] == [4, 2] for c in drafted)
    assert [u["row_kind"] for u in drafted[0]["ubatches"]] == ["gddd", "dd"]
    assert d["speculative"]["n_drafted"] >= 5 and d["effective"]["n_outputs_max"] >= 6
    # the what-if replays the drafts (and the cells their rejection freed): one pass each at -ub 512
    passes = {w["n_ubatch_asked"]: w["n_passes"] for w in d["what_if"]}
    assert passes[4] == d["n_ubatch"] and passes[512] == d["n_decode"]
