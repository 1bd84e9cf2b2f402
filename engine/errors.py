"""Errors a user can act on. The CLI prints `str(err)` as one line and exits 1."""


class UbatchError(Exception):
    """Base class: the message names the problem and what to do about it."""


class ModelLoadError(UbatchError):
    """The model file is missing, not GGUF, truncated, or uses something we do not support."""


class ContextError(UbatchError):
    """A request does not fit the context (prompt too long, batch too large, bad sequence id)."""


def allocate(what: str, nbytes: int, fn):  # type: ignore[no-untyped-def]
    """Run an allocation; on failure say which buffer and how large (llama.cpp names it too)."""
    try:
        return fn()
    except (RuntimeError, MemoryError) as e:
        raise ContextError(
            f"failed to allocate the {what} ({nbytes / 2**20:.2f} MiB): {str(e).splitlines()[0][:120]}; lower -c, -ub or -np (see `ubatch info --fit`)"
        ) from None
