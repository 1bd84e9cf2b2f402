"""The chat package's error, in a module of its own: the Jinja environment (jinja_env.py), the
sandbox it renders in (sandbox.py) and the template loader (template.py) all raise it."""

from __future__ import annotations

from ubatch.engine.errors import UbatchError


class ChatTemplateError(UbatchError):
    """A template that cannot be loaded or rendered, or messages it cannot take."""
