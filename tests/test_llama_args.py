"""Command lines written for llama.cpp work unchanged: every llama.cpp flag of each tool is taken
(implemented, or answered in one line: no effect here and why, or refused and why), multi-letter
flags are whole flags (`-ngl 99` is never `-n gl`), other spellings and `--snake_case` map to
ours, LLAMA_ARG_* variables set what the command line does not, and usage errors are one line
with exit code 1. The real CLI runs on a missing or tiny model, in this process (tests/cli_inproc.py)
or, where a process of its own is the point (the server binds its socket), in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_inproc import run_cli
from typer.main import get_command

from ubatch.cli.llama.command import translate
from ubatch.cli.llama.flags import TOOL_EXAMPLES, flags_for
from ubatch.cli.llama.policy import NO_EFFECT, REFUSED, policy_for
from ubatch.cli.main import app

MISSING = "/nonexistent.gguf"
COMMANDS = get_command(app).commands  # type: ignore[attr-defined]


def run(args: list[str], env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "ubatch.cli.main", *args],
        capture_output=True,
        text=True,
        env=e,
        input=stdin,
        timeout=300,
    )


def test_the_flag_table_is_llama_cpp_s() -> None:
    """The table was read from llama.cpp's source, not typed in: its sizes and some known rows."""
    assert len(flags_for("server")) > 200 and len(flags_for("cli")) > 180 and len(flags_for("bench")) > 40
    by_name = {n: f for f in flags_for("server") for n in f.all_names}
    assert by_name["-ngl"].env == "LLAMA_ARG_N_GPU_LAYERS" and by_name["-ngl"].value == "N"
    assert by_name["--no-context-shift"].names == ("--context-shift",)
    assert by_name["-fa"].value == "[on|off|auto]"
    assert by_name["-np"].help.startswith("number of server slots")  # the server's own -np, not the common one


@pytest.mark.parametrize("name", sorted(TOOL_EXAMPLES))
def test_every_llama_cpp_flag_of_a_tool_is_handled(name: str) -> None:
    """Declared by the command, or answered by the policy table: never "No such option"."""
    cmd = COMMANDS[name]
    unhandled = sorted({f.key for f in cmd.declared.extra.values() if policy_for(f, name) is None})
    assert unhandled == []
    declared = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"-h", "--help", "--version", "--usage"}
    taken = declared | set(cmd.declared.rewrite) | set(cmd.declared.extra)
    assert [n for f in flags_for(name) for n in f.all_names if n not in taken] == []


def test_words_are_translated_as_llama_cpp_reads_them() -> None:
    d = COMMANDS["cli"].declared
    words, answered = translate("cli", d, ["-ngl", "99", "--predict", "5", "--top_k", "3", "--ctx_size", "64"])
    assert words == ["-n", "5", "--top-k", "3", "--ctx-size", "64"]
    assert [(f.names[0], v) for f, v in answered] == [("-ngl", ["99"])]
    words, answered = translate("cli", d, ["-fa", "-m", "x.gguf", "-ngl=7", "--no-mmap"])
    assert words == ["-m", "x.gguf"]  # -fa's value is optional-looking: a flag after it is not its value
    assert [(f.names[0], v) for f, v in answered] == [("-fa", []), ("-ngl", ["7"]), ("--mmap", [])]
    words, _ = translate("cli", d, ["-n", "-1", "-p", "-x"])  # values are taken whatever they look like
    assert words == ["-n", "-1", "-p", "-x"]


def test_policies_say_why() -> None:
    by_name = {n: f for f in flags_for("cli") for n in f.all_names}
    assert policy_for(by_name["-ngl"], "cli").status == NO_EFFECT  # type: ignore[union-attr]
    assert policy_for(by_name["--control-vector"], "cli").status == REFUSED  # type: ignore[union-attr]
    assert policy_for(by_name["--lora"], "batched-bench").status == REFUSED  # type: ignore[union-attr]
    assert "do not use this setting" in policy_for(by_name["--spec-draft-p-split"], "cli").reason  # type: ignore[union-attr]
    assert "has been removed" in policy_for(by_name["--draft-max"], "cli").reason  # type: ignore[union-attr]


CASES: list[tuple[list[str], dict[str, str], int, list[str], list[str]]] = [
    # (args, env, exit code, stderr must contain, stderr must not contain)
    (
        ["cli", "-m", MISSING, "-ngl", "99", "-fa", "on", "-tb", "2"],
        {},
        1,
        ["notice: -ngl 99: no effect here", "notice: -fa on", "notice: -tb 2", "no such file"],
        ["Invalid value", "-n"],
    ),
    (
        ["server", "-m", MISSING, "--n-gpu-layers", "all", "--mlock", "--no-mmap", "-cb", "-sps", "0.5"],
        {},
        1,
        ["notice: -ngl all", "notice: --mlock", "no such file"],
        [],
    ),
    (
        ["cli", "-m", MISSING, "--control-vector", "a.gguf"],
        {},
        1,
        ["error: --control-vector is not supported: control vectors"],
        ["no such file"],
    ),
    (["cli", "-m", MISSING, "--lora", "a.gguf"], {}, 1, ["LoRA adapter not found: a.gguf"], ["no such file"]),
    (["server", "-m", MISSING, "--mmproj", "p.gguf"], {}, 1, ["error: -mm is not supported: ubatch is text-only"], []),
    (["cli", "--bogus"], {}, 1, ["error: invalid argument: --bogus"], ["Usage", "╭"]),
    (["server", "-n", "gl"], {}, 1, ["error: Invalid value for '-n'"], ["╭"]),
    (["cli", "-m", MISSING, "extra"], {}, 1, ["error: "], ["╭"]),
    (["info", "-m", MISSING], {"LLAMA_ARG_CTX_SIZE": "abc"}, 1, ["-c"], ["╭"]),
    (["info", "-m", MISSING], {"LLAMA_ARG_N_GPU_LAYERS": "12"}, 1, ["notice: -ngl 12"], []),
    (
        ["info", "-m", MISSING],
        {"LLAMA_ARG_KV_UNIFIED": "maybe"},
        1,
        ['environment variable "LLAMA_ARG_KV_UNIFIED"'],
        [],
    ),
    (
        ["server", "-m", MISSING, "--spec-draft-n-max", "4", "-md", "d.gguf", "-ngld", "99", "--draft-max", "4"],
        {},
        1,
        ["notice: --spec-draft-ngl 99", "is not supported: the argument has been removed"],
        [],
    ),
    (
        ["bench", "-m", MISSING, "-ngl", "99", "-fa", "1", "-embd", "0"],
        {},
        1,
        ["notice: -ngl 99", "notice: -embd 0"],
        [],
    ),
    (
        ["batched-bench", "-m", MISSING, "-ngl", "99", "-npp", "8", "--temp", "0"],
        {},
        1,
        ["notice: -ngl 99", "notice: --temp 0"],
        [],
    ),
    (["cli", "-m", MISSING, "-l", "12x"], {}, 1, ["-l 12x: expected TOKEN_ID(+/-)BIAS"], ["no such file"]),
    (["tokenize", "-m", MISSING, "-ngl", "99", "-p", "x", "--ids", "--log-disable"], {}, 1, ["notice: -ngl 99"], []),
]


def test_llama_cpp_command_lines_parse_in_one_line() -> None:
    """`server` cases run as processes (the server binds its socket before it loads the model);
    the others through the real CLI in this process (tests/cli_inproc.py)."""
    with ThreadPoolExecutor(2) as pool:
        served = {i: pool.submit(run, c[0], c[1]) for i, c in enumerate(CASES) if c[0][0] == "server"}
        results = [served[i].result() if i in served else run_cli(c[0], c[1]) for i, c in enumerate(CASES)]
    for (args, env, code, want, unwanted), r in zip(CASES, results):
        where = f"{args} {env}: {r.stderr}"
        assert r.returncode == code, where
        assert "Traceback" not in r.stderr, where
        for w in want:
            assert w in r.stderr, where
        for w in unwanted:
            assert w not in r.stderr.replace("-ngl", "").replace("-np", ""), where
        if "error:" in r.stderr:
            assert len([x for x in r.stderr.splitlines() if x.startswith("error")]) == 1, where


def plan(args: list[str], env: dict[str, str], model: Path) -> dict:
    r = run_cli(["info", "-m", str(model), "--json", *args], env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_environment_variables_set_flags_and_the_flag_wins(tiny_llama: Path) -> None:
    env = {
        "LLAMA_ARG_CTX_SIZE": "1024",
        "LLAMA_ARG_N_PARALLEL": "2",
        "LLAMA_ARG_UBATCH": "64",
        "LLAMA_ARG_KV_UNIFIED": "1",
    }
    a = plan([], env, tiny_llama)
    b = plan(["-c", "512", "--ubatch_size", "32"], env, tiny_llama)
    c = plan([], {"LLAMA_ARG_NO_KV_UNIFIED": "1", "LLAMA_ARG_CTX_SIZE": "256"}, tiny_llama)
    assert (a["n_ctx"], a["n_seq_max"], a["n_ubatch"], a["kv_unified"]) == (1024, 2, 64, True)
    assert (b["n_ctx"], b["n_ubatch"]) == (512, 32)  # the command line wins
    assert (c["n_ctx"], c["kv_unified"]) == (256, False)


def test_version_usage_and_help_epilog() -> None:
    v = run(["cli", "--version"])  # a real process, compared with the CLI in this process below
    u, h = run_cli(["server", "--usage"]), run_cli(["server", "--help"])
    assert v.returncode == 0 and v.stdout.startswith("ubatch ")
    top = run_cli(["--version"])
    assert top.returncode == 0 and top.stdout == v.stdout
    assert u.returncode == 0 and "--ctx-size" in u.stdout
    assert "Every other flag of llama-server is accepted too" in " ".join(h.stdout.split())
