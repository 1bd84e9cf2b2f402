"""A group of flags declared once and handed to a command as one dataclass: the sampling flags
(cli/sampling_flags.py) and the speculative ones (cli/spec_flags.py) are added this way to every
command that takes them, so each flag has one definition."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Any


def flag_group(
    cls: type, options: Callable[[Any], dict[str, tuple[Any, Any]]], param: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding `options(cls())` (name -> (annotation, typer.Option)) to a command's
    signature; the command receives them as one `cls` instance in its parameter `param`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        names = [f.name for f in fields(cls)]
        sig = inspect.signature(fn)
        kept = [p for p in sig.parameters.values() if p.name != param]
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=ann)
            for name, (ann, option) in options(cls()).items()
        ]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            flags = cls(**{n: kwargs.pop(n) for n in names})
            return fn(*args, **{param: flags}, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=kept + added)  # type: ignore[attr-defined]
        hints = {k: v for k, v in typing.get_type_hints(fn).items() if k != param}
        wrapper.__annotations__ = hints | {p.name: p.annotation for p in added}
        del wrapper.__wrapped__  # Typer must read the signature above, not fn's
        return wrapper

    return decorate
