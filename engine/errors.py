"""Errors a user can act on. The CLI prints `str(err)` as one line and exits 1."""


class UbatchError(Exception):
    """Base class: the message names the problem and what to do about it."""


class ModelLoadError(UbatchError):
    """The model file is missing, not GGUF, truncated, or uses something we do not support."""


class ContextError(UbatchError):
    """A request does not fit the context (prompt too long, batch too large, bad sequence id)."""
