"""A group of flags declared once and handed to a command as one dataclass: the sampling flags
(cli/sampling_flags.py) and the speculative ones (cli/spec_flags.py) are added this way to every
command that takes them. Each field says everything about its flag in one place (type, default,
spellings, help, panel), so a flag has one definition."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import field, fields
from typing import Any

import typer

from ubatch.cli.options import Spec


def flag(default: Any, *names: str, help: str, panel: str) -> Any:
    """A dataclass field that is also a command-line flag: `seed: int = flag(-1, "-s", "--seed", ...)`."""
    return field(default=default, metadata={"flag": Spec(names, help, panel)})


def flag_group(cls: type, param: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding a typer.Option per field of `cls` (declared with `flag`) to a command's
    signature; the command receives them as one `cls` instance in its parameter `param`."""
    types = typing.get_type_hints(cls)
    specs = [(f.name, f.default, f.metadata["flag"]) for f in fields(cls)]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        added = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(default, *s.names, help=s.help, rich_help_panel=s.panel),
                annotation=types[name],
            )
            for name, default, s in specs
        ]
        sig = inspect.signature(fn)
        kept = [p for p in sig.parameters.values() if p.name != param]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = cls(**{name: kwargs.pop(name) for name, _, _ in specs})
            return fn(*args, **{param: group}, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=kept + added)  # type: ignore[attr-defined]  # inspect reads it; typeshed's functions lack it
        hints = {k: v for k, v in typing.get_type_hints(fn).items() if k != param}
        wrapper.__annotations__ = hints | {p.name: p.annotation for p in added}
        del wrapper.__wrapped__  # Typer must read the signature above, not fn's
        return wrapper

    return decorate
