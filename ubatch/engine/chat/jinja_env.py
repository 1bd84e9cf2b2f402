"""The Jinja environment chat templates are rendered in: a sandbox with the filters and globals
Hugging Face and llama.cpp give templates (`tojson`, `raise_exception`, `strftime_now`), so a
template from a GGUF file renders here as it does there, and cannot touch anything else.

`ChatTemplateError` (errors.py) is raised here first, by the compiler (template.py, which loads
and renders templates, raises it too). The sandbox itself, with the budget each render runs
under (steps, time, sizes), is sandbox.py. jinja2 is imported on first use, so importing the
chat package stays cheap for commands that never render a template."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING

from ubatch.engine.chat.errors import ChatTemplateError

if TYPE_CHECKING:
    import jinja2

__all__ = ["ChatTemplateError", "compile_jinja", "render_jinja"]


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
    from ubatch.engine.chat.sandbox import BudgetedSandbox

    env = BudgetedSandbox()
    env.add_filter("tojson", _tojson)
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
    except (RecursionError, MemoryError, SyntaxError, ValueError) as e:  # nesting Python cannot compile
        raise ChatTemplateError(f"{what}: invalid Jinja chat template ({type(e).__name__}: {e})") from None


def render_jinja(template: jinja2.Template, what: str, input_chars: int, variables: dict[str, object]) -> str:
    """Render under a budget (sandbox.py) sized for `input_chars` characters of messages; a
    template past a limit raises ChatTemplateError naming `what` and the limit."""
    from ubatch.engine.chat.sandbox import render

    return render(template, what, input_chars, variables)
