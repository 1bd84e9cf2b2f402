"""Rich tables keep their layout when stdout is a file or a pipe: no 80-column fallback that
wraps rows and cuts headers to `sequ…`; COLUMNS, when set, still decides. The real CLI runs
as a subprocess, so its stdout is a real pipe (and stderr one too, as under `| less`)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ubatch.cli.memory_view import PIPED_WIDTH, table_console


def explain_piped(model: Path, columns: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS" and not k.startswith("LLAMA_")}
    env |= {"NO_COLOR": "1"} | ({"COLUMNS": columns} if columns is not None else {})
    args = ["explain", "-m", str(model), "-p", "hello world", "-p", "the", "-n", "2", "-c", "512", "-t", "1"]
    r = subprocess.run(
        [sys.executable, "-m", "ubatch.cli.main", *args, "--temp", "0"],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def piped(tiny_gemma: Path) -> dict[str | None, str]:
    """No COLUMNS, and COLUMNS=300: started together (each process imports torch)."""
    widths = [None, "300"]
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(widths, pool.map(lambda c: explain_piped(tiny_gemma, c), widths)))


@pytest.mark.parametrize("columns", [None, "300"])
def test_piped_explain_keeps_every_row_on_one_line(piped: dict[str | None, str], columns: str | None) -> None:
    out = piped[columns]
    lines = out.splitlines()
    assert "…" not in out
    # the decode calls' header, every word whole, on one line
    assert any(all(w in ln.split() for w in ("call", "ub", "rows", "sequences", "graph")) for ln in lines), out
    # memory plan rows: the reason beside its buffer, not wrapped onto a line of its own
    assert any("compute buffer" in ln and "output rows, full KV" in ln for ln in lines), out
    assert any("KV cache" in ln and "K f16 / V f16" in ln for ln in lines), out
    assert not [ln for ln in lines if ln.startswith("│ ") and ln.split("│")[1].strip() == ""], out
    # paragraphs are one line each
    assert any(ln.startswith("compute buffer ") and "would take the same" in ln for ln in lines), out
    assert max(len(ln) for ln in lines) <= (300 if columns else PIPED_WIDTH)


def test_the_table_console_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipe: wide; COLUMNS: as given; a terminal: Rich's own (the window's)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert table_console().width == PIPED_WIDTH
    monkeypatch.setenv("COLUMNS", "123")
    assert table_console().width == 123
