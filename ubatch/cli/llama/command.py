"""Command lines read as llama.cpp reads them.

Every ubatch command is a `LlamaCommand` for one llama.cpp tool. Before Typer parses the words,
`translate` rewrites them against that tool's flag table (cli/llama/flags.py):
- another llama.cpp spelling of a declared option becomes the declared one (`--temperature` ->
  `--temp`, `--ctx_size` -> `--ctx-size`); the default side of a one-way flag (`--warmup` where
  only `--no-warmup` is declared) is dropped;
- every other flag of the tool is taken out with its values and answered in one line: a notice
  (no effect here, and why) or a refusal (cli/llama/policy.py), so `-ngl 99` is one flag, never
  `-n gl`;
- LLAMA_ARG_* environment variables become words for the flags the command line does not give
  (the flag wins over the variable; the value is checked as a typed one would be).
`LlamaGroup` makes every usage error one line on stderr with exit code 1, as llama.cpp does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import typer
from typer._click import exceptions as click_errors  # Typer vendors click; these are its classes
from typer.core import TyperCommand, TyperGroup

from ubatch.cli.llama.flags import LLAMA_TOOL, LlamaFlag, flags_for
from ubatch.cli.llama.policy import NO_EFFECT, policy_for
from ubatch.cli.lora_flags import join_two_argument_form
from ubatch.cli.options import reading_order

_TRUE, _FALSE = ("1", "true", "on", "enabled", "yes"), ("0", "false", "off", "disabled", "no")


@dataclass
class Declared:
    """What a command declares: option word -> (takes a value, the word to use), from its params."""

    takes_value: dict[str, bool] = field(default_factory=dict)
    rewrite: dict[str, str | None] = field(default_factory=dict)  # llama.cpp spelling -> ours (None: drop)
    extra: dict[str, LlamaFlag] = field(default_factory=dict)  # undeclared llama.cpp flags by word


def declare(tool: str, params: list[Any]) -> Declared:
    d = Declared(takes_value={"-h": False, "--help": False})  # the help option is not among params
    owner: dict[str, tuple[Any, bool]] = {}  # word -> (param, is a secondary (negative) word)
    for p in params:
        for o in p.opts:
            owner[o] = (p, False)
            d.takes_value[o] = not getattr(p, "is_flag", False) and not getattr(p, "count", False)
        for o in p.secondary_opts:
            owner[o] = (p, True)
            d.takes_value[o] = False
    for f in flags_for(tool):
        if set(f.names) & {"-h", "--help", "--version"}:
            continue  # --usage is read as --help in _walk; --version is answered in parse_args
        mine = [n for n in f.all_names if n in owner]
        if not mine:
            d.extra.update({n: f for n in f.all_names})
            continue
        p, _ = owner[mine[0]]
        pos = next((n for n in f.names if n in owner and not owner[n][1]), None)
        neg = next((n for n in f.neg if n in owner), None) or next((s for s in p.secondary_opts), None)
        declared_neg = bool(set(p.opts) & set(f.neg))  # a one-way flag spelled --no-x
        for n in f.all_names:
            if n in owner:
                continue
            if not getattr(p, "is_flag", False):
                d.rewrite[n] = mine[0]
            elif n in f.neg:
                d.rewrite[n] = neg if neg is not None else (mine[0] if declared_neg else None)
            else:
                d.rewrite[n] = pos if pos is not None else (None if declared_neg else mine[0])
    return d


def translate(tool: str, d: Declared, args: list[str]) -> tuple[list[str], list[tuple[LlamaFlag, list[str]]]]:
    """(the words for Typer, the undeclared llama.cpp flags given with their values)."""
    given = {_word(a) for a in args if a.startswith("-")}
    env_out, env_answered = _walk(d, _from_env(tool, given))
    out, answered = _walk(d, args)
    return env_out + out, env_answered + answered


def _word(a: str) -> str:
    word = a.partition("=")[0]
    return word.replace("_", "-") if word.startswith("--") else word


def _walk(d: Declared, args: list[str]) -> tuple[list[str], list[tuple[LlamaFlag, list[str]]]]:
    out: list[str] = []
    answered: list[tuple[LlamaFlag, list[str]]] = []
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if not a.startswith("-") or a == "-" or a == "--":
            out.append(a)
            if a == "--":
                out += args[i:]
                break
            continue
        _, eq, value = a.partition("=")
        word = _word(a)  # llama.cpp reads --ctx_size as --ctx-size
        if word == "--usage":
            word = "--help"
        if word in d.extra:
            f = d.extra[word]
            n = f.n_values if word in f.names else 0
            if n and not eq and (f.value or "").startswith("[") and (i >= len(args) or _is_flag(args[i])):
                n = 0  # an optional-looking value ([on|off|auto]) before another flag: none given
            vals = ([value] if eq else []) + args[i : i + n - bool(eq)]
            i += max(0, n - bool(eq))
            answered.append((f, vals))
            continue
        if word in d.rewrite:
            target = d.rewrite[word]
            if target is None:
                continue
            word = target
        out.append(word + eq + value)
        if not eq and d.takes_value.get(word) and i < len(args):
            out.append(args[i])  # the value, whatever it looks like (-n -1)
            i += 1
    return out, answered


def _is_flag(word: str) -> bool:
    return word.startswith("-") and not word.lstrip("-").replace(".", "", 1).isdigit()


def _from_env(tool: str, given: set[str]) -> list[str]:
    """LLAMA_ARG_* variables as command-line words, for the flags not on the command line."""
    out: list[str] = []
    for f in flags_for(tool):
        if f.env is None or given & set(f.all_names):
            continue
        neg_env = f.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
        value = "0" if f.neg and neg_env in os.environ else os.environ.get(f.env)
        if value is None:
            continue
        if f.n_values:
            out += [f.names[-1], value]
        elif value.strip().lower() in _TRUE:
            out.append(f.names[-1])
        elif value.strip().lower() in _FALSE:
            out += [f.neg[-1]] if f.neg else []
        else:
            raise click_errors.UsageError(
                f'error while handling environment variable "{f.env}": invalid value "{value}"'
            )
    return out


class TidyHelp:
    """-h/--help shown as the flag it is: Typer's help option would print a `<bool>` type, as if
    it took a value (a mixin for click commands and groups)."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]  # the click class it is mixed into has it
        if option is not None:
            option.metavar = ""
        return option


class PlainCommand(TidyHelp, TyperCommand):
    """A command with no llama.cpp counterpart (`ubatch convert`)."""


class LlamaCommand(TidyHelp, TyperCommand):
    tool: ClassVar[str] = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params = reading_order(self.params)
        self.declared = declare(self.tool, self.params)
        n_extra = len({f.key for f in self.declared.extra.values()})
        if n_extra:
            note = (
                f"Every other flag of {LLAMA_TOOL[self.tool]} is accepted too ({n_extra} more): each says in one "
                "line that it has no effect here and why, or why it is refused (docs/compat.md). "
                "LLAMA_ARG_* environment variables set the flags a command line does not give."
            )
            self.epilog = f"{self.epilog}\n\n{note}" if self.epilog else note

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if "--version" in args:
            print_version()
            raise typer.Exit(0)
        words, answered = translate(self.tool, self.declared, args)
        rest = super().parse_args(ctx, words)
        for f, values in answered:  # after parsing, so a usage error comes first and alone
            answer(self.tool, f, values)
        return rest


def print_version() -> None:
    from ubatch import __version__  # not importlib.metadata: that scans every installed package

    typer.echo(f"ubatch {__version__}")


def answer(tool: str, f: LlamaFlag, values: list[str]) -> None:
    """The one-line notice for a flag that has no effect here, or the refusal."""
    p = policy_for(f, tool)
    shown = " ".join([f.names[0], *values])
    if p is not None and p.status == NO_EFFECT:
        typer.echo(f"notice: {shown}: no effect here ({p.reason})", err=True)
        return
    raise click_errors.UsageError(f"{f.names[0]} is not supported: {p.reason if p else 'not implemented in ubatch'}")


def llama_command(tool: str) -> type[LlamaCommand]:
    """The command class for one ubatch command (`cls=` of app.command)."""
    return type(f"LlamaCommand_{tool.replace('-', '_')}", (LlamaCommand,), {"tool": tool})


class LlamaGroup(TidyHelp, TyperGroup):
    """Usage errors as llama.cpp prints them: one line on stderr, exit code 1, no panel."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        words = sys.argv[1:] if args is None else list(args)
        if words[:1] == ["--version"]:  # `ubatch --version`, as every llama.cpp tool answers it
            print_version()
            if standalone_mode:
                sys.exit(0)
            return 0
        args = join_two_argument_form(words)
        try:
            rv = super().main(
                args, prog_name, complete_var, standalone_mode=False, windows_expand_args=windows_expand_args, **extra
            )
        except click_errors.NoArgsIsHelpError as e:  # `ubatch` alone: the help (Rich printed it already)
            if e.format_message().strip():
                typer.echo(e.format_message())
            rv = 1
        except click_errors.NoSuchOption as e:
            typer.echo(f"error: invalid argument: {e.option_name} (see --help)", err=True)
            rv = 1
        except click_errors.ClickException as e:
            typer.echo(f"error: {e.format_message()}".replace("\n", " "), err=True)
            rv = 1
        except typer.Abort:
            rv = 1
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)
