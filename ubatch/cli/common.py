"""Pieces every command shares: error reporting, model resolution with a progress bar."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import typer
from rich.console import Console
from rich.errors import LiveError
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from ubatch.engine.errors import UbatchError

err_console = Console(stderr=True, highlight=False)
F = TypeVar("F", bound=Callable[..., Any])


def fail(msg: str) -> None:
    """The one error line; msg is printed as it is (a path's `[x]` or `:abc:` is no markup or emoji)."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", msg), soft_wrap=True)
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
            raise typer.Exit(130) from None
        except BrokenPipeError:
            sys.stderr.close()
            raise typer.Exit(0) from None

    return cast(F, wrapper)  # functools.wraps keeps fn's signature; mypy cannot see that


def read_text_file(path: Path, what: str = "prompt file", errors: str = "strict") -> str:
    """A text file's contents, or a one-line UbatchError (missing, unreadable, not UTF-8 unless
    `errors` says how to decode such bytes)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UbatchError(f"{path}: cannot read {what} ({e.strerror})") from None
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as e:
        raise UbatchError(f"{path}: {what} is not UTF-8 text (invalid byte at offset {e.start})") from None


def check_text(text: str, what: str) -> str:
    """`text` if it is valid Unicode; undecodable argv bytes (surrogate escapes) or JSON lone
    surrogates would otherwise crash the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UbatchError(f"{what} is not valid UTF-8 text (bad character at offset {e.start})") from None
    return text


_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}
_HEX = frozenset(b"0123456789abcdefABCDEF")


def process_escapes(text: str) -> str:
    """llama.cpp's string_process_escapes: \\n \\r \\t \\' \\" \\\\ and \\xHH; any other
    backslash sequence is kept as typed."""
    if "\\" not in text:
        return text
    b, out, i = text.encode("utf-8"), bytearray(), 0
    while i < len(b):
        c = b[i]
        if c == 0x5C and i + 1 < len(b):
            i += 1
            e = b[i]
            if e in _ESCAPES:
                out += _ESCAPES[e]
            elif e == ord("x") and i + 2 < len(b) and b[i + 1] in _HEX and b[i + 2] in _HEX:
                out.append(int(b[i + 1 : i + 3], 16))
                i += 2
            else:
                out += bytes((0x5C, e))
        else:
            out.append(c)
        i += 1
    return out.decode("utf-8", errors="replace")


class AssemblyBar:
    """The `progress(done_bytes, total_bytes)` callback of default_model_path: a Rich bar on stderr,
    started by the first call, so a cached model (no calls) shows nothing."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console if console is not None else err_console
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.progress is None:
            self.progress = Progress(
                TextColumn("assembling the default model"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.progress.start()
            self.task = self.progress.add_task("assemble", total=total)
        assert self.task is not None
        self.progress.update(self.task, completed=done, total=total)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


@contextlib.contextmanager
def kernel_build_status(line: str) -> Iterator[None]:
    """The CPU kernels' `on_build`: a spinner with `line` on stderr while a cold build compiles (a
    terminal only, like the default model's bar; a build from the cache shows nothing)."""
    status = err_console.status(line, spinner="dots")
    try:
        status.start()
    except LiveError:  # an older Rich allows one live display: the line above the running one
        err_console.print(line, markup=False)
    try:
        yield
    finally:
        status.stop()  # a status that did not start stops as a no-op


def watch_kernel_builds() -> None:
    """Show a cold kernel build (first run on this CPU: seconds) instead of a blank wait. The
    kernels never print; the commands that load a model call this (cli/device.py)."""
    from ubatch.kernels.cpu import build

    build.on_build = kernel_build_status


def resolve_model(path: Path | None) -> Path:
    """-m PATH as given, or the default Gemma 3 270M assembled once into the cache directory."""
    if path is not None:
        return path
    from ubatch.engine.model.default_model import default_model_path

    bar = AssemblyBar()
    try:
        return default_model_path(bar)
    finally:
        bar.stop()
