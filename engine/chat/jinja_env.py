"""The Jinja environment chat templates are rendered in: a sandbox with the filters and globals
Hugging Face and llama.cpp give templates (`tojson`, `raise_exception`, `strftime_now`), so a
template from a GGUF file renders here as it does there, and cannot touch anything else.

`ChatTemplateError` lives here, with the compiler that raises it first (template.py, which loads
and renders templates, raises it too). jinja2 is imported on first use, so importing the chat
package stays cheap for commands that never render a template."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING

from ubatch.engine.errors import UbatchError

if TYPE_CHECKING:
    import jinja2


class ChatTemplateError(UbatchError):
    """A template that cannot be loaded or rendered, or messages it cannot take."""


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's tojson: no HTML escaping, unicode kept
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # the options Hugging Face and llama.cpp's Jinja engine use
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def compile_jinja(source: str, what: str = "chat template") -> jinja2.Template:
    """The compiled template, or ChatTemplateError naming `what` and the line."""
    import jinja2

    try:
        return _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{what}: invalid Jinja chat template (line {e.lineno}: {e.message})") from None
