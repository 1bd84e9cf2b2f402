"""The real CLI (the same Typer app as the `ubatch` script) run in this process: for the many
command lines that fail before a model loads, and for runs on a small model, a subprocess would
spend seconds starting Python and importing torch for milliseconds of work. Results look like
subprocess.CompletedProcess."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from typer.testing import CliRunner

from ubatch.cli.main import app


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run_cli(args: list[str], env: dict[str, str] | None = None, stdin: str = "") -> Ran:
    """`ubatch ARGS` with LLAMA_* variables cleared except those in `env`, a narrow terminal.
    A run that makes a context sets torch's thread count (-t); the count this process had is put
    back, so later tests do not inherit one run's -t."""
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("LLAMA_")}
    clean |= {"COLUMNS": "80", "NO_COLOR": "1"} | (env or {})
    torch = sys.modules.get("torch")  # not imported here: a command that fails early never needs it
    threads = torch.get_num_threads() if torch is not None else 0
    try:
        r = CliRunner().invoke(app, args, env=clean, input=stdin)
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception  # a traceback is a bug, never an answer
    return Ran(r.exit_code, r.stdout, r.stderr)
