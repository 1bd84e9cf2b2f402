"""Where `ubatch bench` writes: `-o FORMAT|FILE` and `--plot FILE`, checked before the run.

A benchmark can take minutes, so a destination that could not be written afterwards (a missing
directory, a read-only file, an unknown extension) is refused up front with a one-line error.
"""

from __future__ import annotations

import os
from pathlib import Path

from ubatch.cli.bench.format import FORMATS
from ubatch.cli.bench.params import BenchError


def output_target(value: str, flag: str = "-o") -> tuple[str, Path | None]:
    """-o md|csv|json|jsonl prints to stdout; -o FILE.{md,csv,json,jsonl} writes that file."""
    if value in FORMATS:
        return value, None
    path = Path(value)
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise BenchError(
            f"{flag} {value!r}: use a format ({', '.join(FORMATS)}) or a file name ending in .md, .csv, .json or .jsonl"
        )
    check_writable(path, flag)
    return fmt, path


def check_writable(path: Path, flag: str) -> None:
    """Fail before the (long) run if the file could not be written afterwards."""
    if path.is_dir():
        raise BenchError(f"{flag} {path}: is a directory, not a file")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise BenchError(f"{flag} {path}: {parent} is not a directory")
    if not parent.is_dir():
        raise BenchError(f"{flag} {path}: directory {parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise BenchError(f"{flag} {path}: file is not writable")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise BenchError(f"{flag} {path}: directory {parent} is not writable")


def write_file(path: Path, text: str, flag: str) -> None:
    """Write the results; an OSError becomes the one-line error the CLI prints."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise BenchError(f"{flag} {path}: cannot write ({e.strerror})") from None


def check_plot_path(path: Path) -> None:
    """--plot FILE: writable, and an image type matplotlib can save."""
    check_writable(path, "--plot")
    ext = path.suffix.lstrip(".").lower()
    if ext not in ("png", "svg", "pdf", "jpg", "jpeg", "webp"):
        raise BenchError(f"--plot {path}: use a .png, .svg, .pdf, .jpg or .webp file name")


__all__ = ["output_target", "check_writable", "write_file", "check_plot_path"]
