"""A group of flags declared once and handed to a command as one dataclass: the sampling flags
(cli/sampling_flags.py) and the speculative ones (cli/spec_flags.py) are added this way to every
command that takes them. Each field says everything about its flag in one place (type, default,
spellings, help, panel), so a flag has one definition."""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import typer

from ubatch.cli.options import OPTIONS, Spec


def flag(default: Any, *names: str, help: str, panel: str) -> Any:
    """A dataclass field that is also a command-line flag: `seed: int = flag(-1, "-s", "--seed", ...)`."""
    return field(default=default, metadata={"flag": Spec(names, help, panel)})


def shared_flag(name: str, default: Any, *, help: str | None = None, panel: str | None = None) -> Any:
    """A field for a flag of cli/options.py's `OPTIONS` (one a command may also take alone);
    `help` and `panel` refine the shared ones, as `opt` does."""
    s = OPTIONS[name]
    return field(default=default, metadata={"flag": Spec(s.names, help or s.help, panel or s.panel)})


@dataclass(frozen=True, slots=True)
class Refine:
    """A command's own take on a shared flag: its default, help, spellings or panel (llama-server's
    -np defaults to -1 and says "slots"; llama-cli's to 1). None keeps the group's."""

    default: Any = None
    help: str | None = None
    names: tuple[str, ...] | None = None
    panel: str | None = None
    keep_default: bool = True  # False: `default` replaces the group's, even when it is None


def refine(
    default: Any = None, *, help: str | None = None, names: tuple[str, ...] | None = None, panel: str | None = None
) -> Refine:
    """`Refine` with a new default; `Refine(help=...)` alone keeps the group's default."""
    return Refine(default, help, names, panel, keep_default=False)


def _flag_types(cls: type) -> dict[str, Any]:
    """The annotations of `cls`'s flag fields, evaluated: its other fields may name types it
    imports only for type checking (an options class kept free of the engine's imports)."""
    scope = vars(sys.modules[cls.__module__])
    return {
        f.name: eval(f.type, scope) if isinstance(f.type, str) else f.type  # noqa: S307  # what get_type_hints does
        for f in fields(cls)
        if "flag" in f.metadata
    }


def flag_group(
    cls: type,
    param: str,
    refined: Mapping[str, Refine] | None = None,
    omit: Collection[str] = (),
    panel: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding a typer.Option per field of `cls` (declared with `flag`) to a command's
    signature; the command receives them as one `cls` instance in its parameter `param`.

    `refined` changes a flag for this command, `omit` leaves one out (its field keeps the group's
    default) and `panel` moves all of them under one --help heading."""
    types = _flag_types(cls)
    specs = []
    for f in fields(cls):
        if f.name in omit or "flag" not in f.metadata:  # a field the group keeps for itself
            continue
        s, default, r = f.metadata["flag"], f.default, (refined or {}).get(f.name)
        if r is not None:
            default = default if r.keep_default else r.default
            s = Spec(r.names or s.names, r.help or s.help, r.panel or s.panel)
        specs.append((f.name, default, Spec(s.names, s.help, panel or s.panel)))

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
