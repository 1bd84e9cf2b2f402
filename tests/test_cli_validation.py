"""Every command-line value is checked before the model loads: one line naming the flag, the
value and what is allowed, exit 1, no traceback.

Each case passes `-m /nonexistent.gguf` with the bad value: an error about the value (not about
the file) shows the check ran first. The cases run through the real CLI in this process
(tests/cli_inproc.py); one of each kind also runs as a real process and must answer the same.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cli_inproc import Ran, run_cli

MISSING = "/nonexistent.gguf"

# (command, flags, what stderr must say)
BAD: list[tuple[str, list[str], str]] = [
    ("cli", ["-ub", "-1"], "-ub -1: invalid value for n_ubatch: cannot be negative; use 0 (n_batch)"),
    ("cli", ["-b", "0"], "-b 0: invalid value for n_batch"),
    ("cli", ["-c", "-5"], "-c -5: invalid value for n_ctx: cannot be negative; use 0 (from the model)"),
    ("cli", ["-c", "4294967296"], "-c 4294967296: invalid value for n_ctx"),
    ("cli", ["-np", "0"], "-np 0: invalid value for n_parallel: must be at least 1"),
    ("cli", ["-np", "257"], "-np 257: invalid value for n_parallel: must be between 1 and 256"),
    ("cli", ["-t", "0"], "-t 0: invalid value for n_threads: use -1 (all cores)"),
    ("cli", ["-t", "-2"], "-t -2: invalid value for n_threads"),
    ("cli", ["-n", "-2"], "-n -2: invalid value for n_predict: use -1 (unlimited)"),
    ("cli", ["--keep", "-2"], "--keep -2: invalid value for n_keep"),
    ("cli", ["--n-outputs-max", "-1"], "--n-outputs-max -1: invalid value for n_outputs_max"),
    ("cli", ["--temp", "nan"], "--temp nan: invalid value for temp: must be a finite number"),
    ("cli", ["--temp", "inf"], "--temp inf: invalid value for temp"),
    ("cli", ["--top-k", "-1"], "--top-k -1: invalid value for top_k"),
    ("cli", ["--top-p", "1.5"], "--top-p 1.5: invalid value for top_p: must be between 0 and 1"),
    ("cli", ["--min-p", "-0.1"], "--min-p -0.1: invalid value for min_p"),
    ("cli", ["-s", "-2"], "-s -2: invalid value for seed: use -1 (random)"),
    ("cli", ["-s", "4294967296"], "-s 4294967296: invalid value for seed"),
    ("cli", ["--repeat-penalty", "0"], "--repeat-penalty 0.0: invalid value for penalty_repeat: must be above 0"),
    ("cli", ["--repeat-penalty", "nan"], "--repeat-penalty nan: invalid value for penalty_repeat"),
    ("cli", ["--repeat-last-n", "-2"], "--repeat-last-n -2: invalid value for penalty_last_n"),
    ("cli", ["-ctk", "q9"], "-ctk 'q9': invalid value for the KV cache type of K: use one of f32, f16"),
    ("cli", ["--backend", "cuda9"], "--backend 'cuda9': unknown backend 'cuda9'; use one of auto"),
    ("server", ["-np", "0"], "-np 0: invalid value for n_parallel: use -1 (auto)"),
    ("server", ["-np", "-3"], "-np -3: invalid value for n_parallel"),
    ("server", ["--port", "65536"], "--port 65536: invalid value for port: must be between 0 and 65535"),
    ("server", ["-to", "0"], "-to 0: invalid value for timeout"),
    (
        "server",
        ["--cache-reuse", "-1"],
        "--cache-reuse -1: invalid value for n_cache_reuse: cannot be negative; use 0 (off)",
    ),
    ("server", ["--host", ","], "--host ',': invalid value for host: give at least one address"),
    ("server", ["-sps", "nan"], "-sps nan: invalid value for slot_prompt_similarity"),
    ("server", ["--temp", "nan"], "--temp nan: invalid value for temp"),
    ("bench", ["-ub", "512,-1"], "-ub: invalid value '-1'"),
    ("bench", ["-t", "0"], "-t 0: invalid value for n_threads: must be at least 1"),
    ("bench", ["-r", "0"], "-r 0: invalid value for reps: must be at least 1"),
    ("bench", ["-b", "0-4"], "-b 0: invalid value for n_batch"),
    ("bench", ["--delay", "nan"], "--delay nan: invalid value for delay"),
    ("bench", ["--sweep-ub", "0-8+4"], "--sweep-ub 0: invalid value for n_ubatch"),
    ("bench", ["-p", "1-2000000000"], "-p '1-2000000000': more than 4096 values"),
    ("bench", ["-n", "3000000000"], "-n '3000000000': invalid value: must be at most 2147483647"),
    ("batched-bench", ["-npl", "0"], "-npl 0: invalid value for n_pl: must be at least 1"),
    ("batched-bench", ["-npl", "1,300"], "-npl 300: invalid value for n_parallel"),
    ("batched-bench", ["-t", "0"], "-t 0: invalid value for n_threads"),
    ("batched-bench", ["--output-format", "csv"], "--output-format 'csv': invalid value for output format"),
    ("info", ["-np", "0"], "-np 0: invalid value for n_parallel"),
    ("info", ["-c", "-1"], "-c -1: invalid value for n_ctx"),
    ("info", ["-ub", "-2"], "-ub -2: invalid value for n_ubatch"),
    ("info", ["--n-outputs-max", "-3"], "--n-outputs-max -3: invalid value for n_outputs_max"),
    ("info", ["--fit", "0"], "--fit '0': invalid value for the memory budget"),
]

# llama.cpp's sentinels pass the checks: the process goes on to the model and fails on the file
SENTINELS: list[tuple[str, list[str]]] = [
    ("cli", ["-c", "0", "-n", "-1", "-t", "-1", "-s", "-1", "--keep", "-1", "--repeat-last-n", "-1", "--temp", "-1"]),
    ("cli", ["-p", "x", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--n-outputs-max", "0", "-np", "256"]),
    ("cli", ["-ub", "0"]),  # llama.cpp's n_ubatch = n_batch
    ("server", ["-ub", "0"]),
    ("info", ["-ub", "0"]),
    ("bench", ["-t", "1,2", "-d", "0", "-nom", "0", "-r", "1"]),
]


@pytest.fixture(scope="module")
def runs() -> dict[int, Ran]:
    """Each case through the real CLI in this process (see cli_inproc.py), one after another;
    `test_a_subprocess_says_the_same` checks that a real process answers the same."""
    cases = [(c, f) for c, f, _ in BAD] + SENTINELS
    return {i: run_cli([c, "-m", MISSING, *f]) for i, (c, f) in enumerate(cases)}


@pytest.mark.parametrize("i", range(len(BAD)), ids=[f"{c} {' '.join(f)}" for c, f, _ in BAD])
def test_bad_value_is_one_line_before_the_model(runs: dict, i: int) -> None:
    cmd, flags, needle = BAD[i]
    r = runs[i]
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, (r.returncode, r.stderr)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1, r.stderr
    assert err[0].startswith("error: ") and needle in err[0], err[0]
    assert MISSING not in r.stderr and r.stdout == ""  # the value was refused before the file was opened


@pytest.mark.parametrize("i", range(len(SENTINELS)), ids=[f"{c} {' '.join(f)}" for c, f in SENTINELS])
def test_sentinels_pass_the_checks(runs: dict, i: int) -> None:
    r = runs[len(BAD) + i]
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1 and MISSING in r.stderr, r.stderr  # got as far as the model file
    assert "invalid value" not in r.stderr, r.stderr


def test_a_subprocess_says_the_same(runs: dict[int, Ran]) -> None:
    """The in-process answers are the ones a real `ubatch` process gives (one of each kind)."""
    for i in (0, len(BAD) - 1):
        cmd, flags, _ = BAD[i]
        env = dict(os.environ, COLUMNS="80", NO_COLOR="1")
        argv = [sys.executable, "-m", "ubatch.cli.main", cmd, "-m", MISSING, *flags]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
        assert (r.returncode, r.stderr) == (runs[i].returncode, runs[i].stderr)
