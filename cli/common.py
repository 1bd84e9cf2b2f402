"""Pieces every command shares: error reporting, model resolution with a progress bar."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from ..engine.errors import UbatchError

err_console = Console(stderr=True, highlight=False)
F = TypeVar("F", bound=Callable[..., Any])


def fail(msg: str) -> None:
    err_console.print(f"[bold red]error:[/] {msg}", markup=True, soft_wrap=True)
    raise typer.Exit(1)


def user_errors(fn: F) -> F:
    """Turn engine errors into one line on stderr and exit code 1: never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UbatchError as e:
            fail(str(e).replace("[", r"\["))
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130)
        except BrokenPipeError:
            sys.stderr.close()
            raise typer.Exit(0)

    return wrapper  # type: ignore[return-value]


def resolve_model(path: Path | None) -> Path:
    """-m PATH as given, or the default Gemma 3 270M assembled once into the cache directory."""
    if path is not None:
        return path
    from ..engine.default_model import default_model_path

    progress: Progress | None = None
    task = None

    def report(done: int, total: int) -> None:
        nonlocal progress, task
        if progress is None:
            progress = Progress(TextColumn("assembling default model"), BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), console=err_console, transient=True)
            progress.start()
            task = progress.add_task("assemble", total=total)
        progress.update(task, completed=done)

    try:
        return default_model_path(report)
    finally:
        if progress is not None:
            progress.stop()
