"""The first seconds of every command (issue 33): --help, --version and a mistyped command line
answer without loading torch, numpy, FastAPI or the engine; a first run says that it is
compiling the CPU kernels instead of waiting in silence; --help reads in order; `-ub 0` means
n_batch, as in llama.cpp. The real CLI runs in fresh processes (the --help and usage-error probes
share one), but for the `-ub 0` check; nothing here measures time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_inproc import run_cli

from ubatch.cli.options import PANEL_ORDER, PROMPT_CACHE

HEAVY = ("torch", "numpy", "gguf", "fastapi", "uvicorn", "starlette", "ubatch.engine.params")
# Runs the `ubatch` app on each argv of a JSON list, one after another in one fresh process, and
# reports per run its exit code, its output and which heavy modules the process had imported by
# then (once imported a module stays, so a run that loads one fails every later run too).
PROBE = """
import contextlib, io, json, sys
from ubatch.cli.main import app
runs = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            app(argv, prog_name="ubatch")
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code
    loaded = [m for m in HEAVY if m in sys.modules]
    runs.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "loaded": loaded})
sys.stdout.write(json.dumps(runs))
"""

HELP = [
    ["--help"],
    ["--version"],
    ["cli", "--help"],
    ["cli", "--version"],
    ["explain", "--help"],
    ["info", "--help"],
    ["bench", "--help"],
    ["batched-bench", "--help"],
    ["tokenize", "--help"],
    ["convert", "--help"],
    ["server", "--help"],
]
USAGE_ERRORS = [
    (["cli", "-c", "abc"], "'-c' / '--ctx-size'"),  # a type error (Typer's)
    (["cli", "--no-such-flag"], "invalid argument: --no-such-flag"),
    (["nosuchcommand"], "No such command"),
    (["cli", "-np", "0"], "-np 0: invalid value for n_parallel"),  # a value error (cli/validate.py)
    (["cli", "-ub", "-1"], "-ub -1: invalid value for n_ubatch"),
    (["cli", "--temp", "nan"], "--temp nan: invalid value for temp"),
    (["cli", "--device", "tpu"], "--device tpu: unknown device"),  # every check before torch's own
    (["explain", "-np", "0", "-p", "x"], "-np 0: invalid value for n_parallel"),
    (["server", "-np", "0"], "-np 0: invalid value for n_parallel"),
    (["server", "--port", "70000"], "--port 70000: invalid value for port"),
    (["info", "--fit", "0"], "invalid value for the memory budget"),
    (["bench", "-r", "0"], "-r 0: invalid value for reps"),
    (["convert", "/nonexistent", "-o", "x.gguf", "--outtype", "q9"], "--outtype 'q9'"),
]


def env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    return clean | {"COLUMNS": "200", "NO_COLOR": "1"} | extra


@dataclass
class Probed:
    code: int
    stdout: str
    stderr: str
    loaded: list[str]


@pytest.fixture(scope="module")
def probed() -> dict[tuple[str, ...], Probed]:
    """Every command line below, in one fresh process that starts Python once, not once each."""
    argvs = [[], *HELP, *(a for a, _ in USAGE_ERRORS)]
    code = f"HEAVY = {HEAVY!r}\n{PROBE}"
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    return {tuple(a): Probed(**run) for a, run in zip(argvs, json.loads(r.stdout))}


@pytest.mark.parametrize("args", HELP, ids=" ".join)
def test_help_and_version_load_nothing_heavy(probed: dict[tuple[str, ...], Probed], args: list[str]) -> None:
    r = probed[tuple(args)]
    assert r.code == 0, r.stderr
    assert r.loaded == []
    assert r.stdout.strip()


@pytest.mark.parametrize(("args", "needle"), USAGE_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_usage_errors_answer_before_anything_heavy_loads(
    probed: dict[tuple[str, ...], Probed], args: list[str], needle: str
) -> None:
    r = probed[tuple(args)]
    assert r.code == 1
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and needle in errors[0], r.stderr
    assert r.loaded == []


def test_no_command_is_the_help_alone(probed: dict[tuple[str, ...], Probed]) -> None:
    r = probed[()]
    assert r.code == 1 and "Usage: ubatch [OPTIONS] COMMAND" in r.stdout and r.loaded == []
    assert r.stderr.strip() == ""  # no empty "error:" line


def test_top_level_help_imports_no_command_module() -> None:
    code = (
        "import sys\nfrom ubatch.cli.main import app\n"
        "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('ubatch.cli.') and m.endswith(('command', 'info', 'tokenize', 'convert'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env())
    assert r.stdout.strip().splitlines()[-1] == "['ubatch.cli.llama.command']"  # the group's own module only
    for name in ("cli", "server", "bench", "batched-bench", "info", "explain", "tokenize", "convert"):
        assert re.search(rf"^│ {re.escape(name)} +\S", r.stdout, re.M), name


def test_python_m_ubatch_is_the_ubatch_command() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ubatch", "--help"], capture_output=True, text=True, timeout=120, env=env()
    )
    assert r.returncode == 0 and "Usage: ubatch [OPTIONS] COMMAND" in r.stdout
    v = subprocess.run([sys.executable, "-m", "ubatch", "--version"], capture_output=True, text=True, timeout=120)
    from importlib.metadata import version

    assert v.stdout == f"ubatch {version('ubatch')}\n"  # ubatch.__version__ is the installed one


def panels(help_text: str) -> list[str]:
    return re.findall(r"^╭─ (.+?) ─", help_text, re.M)


def help_of(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "ubatch", *args, "--help"], capture_output=True, text=True, timeout=120, env=env()
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_help_reads_in_order_and_h_takes_no_value() -> None:
    text = help_of("cli")
    shown = panels(text)
    assert shown[0] == "Options"  # Typer prints its own panel first: only -h is left there
    assert [p for p in shown if p in PANEL_ORDER] == list(PANEL_ORDER)
    assert shown[1 : 1 + len(PANEL_ORDER)] == list(PANEL_ORDER)  # the main ones first, the rest after
    assert PROMPT_CACHE in shown and "--prompt-cache-ro" in text.split(f"─ {PROMPT_CACHE} ─")[1]
    for t in (text, help_of(), help_of("convert")):
        h = [ln for ln in t.splitlines() if re.search(r"\s-h\s", ln)]
        assert h and "<bool>" not in h[0], h
    assert panels(help_of("bench"))[:2] == ["Options", "Tests"]  # a command's own leading panels stay in front


def test_reading_order_keeps_each_panel_s_options_in_order() -> None:
    from ubatch.cli.options import reading_order

    class P:
        def __init__(self, name: str, panel: str | None) -> None:
            self.name, self.rich_help_panel = name, panel

    ps = [P("a", "Own"), P("b", "Output"), P("c", "Model"), P("d", "Extra"), P("e", None), P("f", "Model")]
    assert [p.name for p in reading_order(ps)] == ["a", "e", "c", "f", "b", "d"]


def test_convert_names_the_engine_s_outtypes() -> None:
    from ubatch.cli.convert import OUTTYPES
    from ubatch.engine.model.hf.convert import OUTTYPES as ENGINE_OUTTYPES

    assert OUTTYPES == tuple(ENGINE_OUTTYPES)


def test_ub_0_is_n_batch_as_in_llama_cpp(tiny_gemma: Path) -> None:
    """llama_context: n_ubatch = min(n_batch, n_ubatch ? n_ubatch : n_batch). Not about startup:
    the real CLI in this process (tests/cli_inproc.py) saves two imports of torch."""
    base = ["info", "-m", str(tiny_gemma), "-c", "256", "-b", "64", "-ub", "0"]
    r = run_cli([*base, "--json"], {"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["n_batch"], d["n_ubatch"]) == (64, 64)
    r = run_cli([*base, "-v"], {"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert re.search(r"^llama_context: n_ubatch += 64$", r.stdout, re.M), r.stdout


def test_a_cold_kernel_build_says_so_on_a_terminal(tiny_gemma: Path, tmp_path: Path) -> None:
    """An empty kernel cache (a first run): one status line while the compiler runs, on a
    terminal; nothing once the library is cached, and nothing in a pipe (as the model's bar)."""
    pexpect = pytest.importorskip("pexpect")
    from ubatch.kernels.cpu.build import _compiler

    if _compiler() is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built here")
    args = ["-m", "ubatch", "cli", "-m", str(tiny_gemma), "-p", "hi", "-n", "1", "--backend", "cpu-portable"]
    e = env(XDG_CACHE_HOME=str(tmp_path), TERM="xterm")
    e.pop("NO_COLOR")

    def on_terminal() -> str:
        child = pexpect.spawn(sys.executable, args, env=e, encoding="utf-8", timeout=240, dimensions=(24, 120))
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0, child.before
        return str(child.before)

    cold = on_terminal()
    assert "compiling the portable CPU kernels, once: ~1 s" in cold
    assert list((tmp_path / "ubatch" / "kernels").glob("cpu_kernels-portable-*.so"))
    assert "compiling" not in on_terminal()  # cached
    for f in (tmp_path / "ubatch" / "kernels").glob("*.so"):
        f.unlink()
    piped = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, env=e)
    assert piped.returncode == 0 and "compiling" not in piped.stderr, piped.stderr
