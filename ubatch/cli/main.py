"""`ubatch`: llama.cpp's tools, re-implemented so that they explain their memory and speed.

A command's module is imported when that command runs or shows its help, never before: the
commands' table below names each one by module, so `ubatch --help`, `ubatch --version` and a
usage error cost Typer and this table, and one command's imports (the server's FastAPI, the
converter's torch) never slow another's start. Within a command, the checks that need only
Python run before anything heavy loads (cli/validate.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import typer
from typer._click.core import Command  # Typer vendors click
from typer.core import TyperCommand
from typer.main import get_command_from_info
from typer.models import CommandInfo

from ubatch.cli.llama.command import LlamaGroup, PlainCommand, llama_command


@dataclass(frozen=True, slots=True)
class Entry:
    """One command: the function that runs it (module and name), the llama.cpp tool whose other
    spellings and LLAMA_ARG_* it takes (cli/llama; None: a command of ubatch's own), its help line."""

    module: str
    function: str
    tool: str | None
    help: str


COMMANDS: dict[str, Entry] = {
    "cli": Entry(
        "ubatch.cli.complete.command",
        "cli",
        "cli",
        "Chat in the terminal (no -p, or -cnv / -sys / -st), or with -p a one-shot completion (like llama-completion).",
    ),
    "server": Entry(
        "ubatch.cli.server.command",
        "server",
        "server",
        "OpenAI- and llama-server-compatible HTTP server: -np slots, continuous batching.",
    ),
    "bench": Entry(
        "ubatch.cli.bench.command",
        "bench",
        "bench",
        "Benchmark like llama-bench: pp/tg t/s, compute buffer, --profile, --sweep-ub plots.",
    ),
    "batched-bench": Entry(
        "ubatch.cli.bench.command",
        "batched_bench",
        "batched-bench",
        "Continuous-batching throughput like llama-batched-bench.",
    ),
    "info": Entry(
        "ubatch.cli.info", "info", "info", "The memory plan of a configuration (KV cache, compute buffer, why)."
    ),
    "explain": Entry(
        "ubatch.cli.explain.command",
        "explain",
        "cli",
        "Run a request and show how it was batched, split, padded and masked, and where the memory went.",
    ),
    "tokenize": Entry("ubatch.cli.tokenize", "tokenize", "tokenize", "Tokenize text like llama-tokenize."),
    "convert": Entry(
        "ubatch.cli.convert",
        "convert",
        None,
        "Write a Hugging Face checkpoint directory as a GGUF file (--outtype f16, bf16, q8_0).",
    ),
}


def build(name: str) -> Command:
    """The click command for `name`, from its module (imported here, on first use)."""
    e = COMMANDS[name]
    fn = getattr(importlib.import_module(e.module), e.function)
    info = CommandInfo(name=name, cls=llama_command(e.tool) if e.tool else PlainCommand, help=e.help, callback=fn)
    return get_command_from_info(
        info, pretty_exceptions_short=app.pretty_exceptions_short, rich_markup_mode=app.rich_markup_mode
    )


class LazyCommands(MutableMapping[str, Command]):
    """The group's commands by name, each built by `build` when first looked up; listing the names
    builds none. Click reads a group's commands through this mapping only."""

    def __init__(self) -> None:
        self.built: dict[str, Command] = {}

    def __getitem__(self, name: str) -> Command:
        if name not in self.built:
            if name not in COMMANDS:
                raise KeyError(name)
            self.built[name] = build(name)
        return self.built[name]

    def __setitem__(self, name: str, command: Command) -> None:
        self.built[name] = command

    def __delitem__(self, name: str) -> None:
        del self.built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*COMMANDS, *self.built]))

    def __len__(self) -> int:
        return len(set(COMMANDS) | set(self.built))


class UbatchGroup(LlamaGroup):
    """`ubatch`: LlamaGroup (llama.cpp's one-line usage errors) over the lazily built commands."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = LazyCommands()

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)  # the names alone: TyperGroup's would build every command

    def format_help(self, ctx: Any, formatter: Any) -> None:
        # `ubatch --help` lists the commands' names and help lines: stand-ins carry them, so
        # listing imports no command's module
        lazy = self.commands
        self.commands = {n: TyperCommand(n, help=e.help) for n, e in COMMANDS.items()}
        try:
            super().format_help(ctx, formatter)
        finally:
            self.commands = lazy


app = typer.Typer(
    name="ubatch",
    cls=UbatchGroup,
    help="A llama.cpp-style runner that shows its work: -c -b -ub -np, KV cache and compute buffer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _group() -> None:
    # Typer makes a group of an app with a callback (it has no registered commands: see COMMANDS)
    pass


if __name__ == "__main__":
    app()
