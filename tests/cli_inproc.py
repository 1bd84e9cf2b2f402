"""The real CLI (the same Typer app as the `ubatch` script) run in this process, for the many
command lines that fail before a model loads: a subprocess would spend a second starting Python
for a few milliseconds of parsing. Results look like subprocess.CompletedProcess."""

from __future__ import annotations

import os
from dataclasses import dataclass

from typer.testing import CliRunner

from ubatch.cli.main import app


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run_cli(args: list[str], env: dict[str, str] | None = None, stdin: str = "") -> Ran:
    """`ubatch ARGS` with LLAMA_* variables cleared except those in `env`, a narrow terminal."""
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("LLAMA_")}
    clean |= {"COLUMNS": "80", "NO_COLOR": "1"} | (env or {})
    r = CliRunner().invoke(app, args, env=clean, input=stdin)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception  # a traceback is a bug, never an answer
    return Ran(r.exit_code, r.stdout, r.stderr)
