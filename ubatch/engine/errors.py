"""Errors a user can act on, each of a kind. The CLI prints `str(err)` as one line and exits 1;
the server maps the kind to llama-server's status code and error JSON (cli/server/http.py), so
nothing in the engine names an HTTP status."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import TypeVar

T = TypeVar("T")


class ErrorKind(Enum):
    """Whose problem an error is, and so what the caller can do about it."""

    INVALID_REQUEST = "invalid request"  # the input (a request, a flag, a file) is wrong: fix it
    EXCEEDS_CONTEXT = "exceeds context"  # the prompt leaves no room in the context: shorten it or raise -c
    NOT_SUPPORTED = "not supported"  # a feature this model or server lacks, or was not started with
    UNAVAILABLE = "unavailable"  # not now: the model is loading or the server is shutting down
    NOT_FOUND = "not found"  # no such route or resource
    UNAUTHORIZED = "unauthorized"  # no valid API key
    INTERNAL = "internal"  # the engine failed (a decode, a file it writes, a bug): not the caller's fault


class UbatchError(Exception):
    """Base class: the message names the problem and what to do about it. A subclass is one
    kind (the input is wrong, unless it says otherwise); `EngineError` is given its kind."""

    kind: ErrorKind = ErrorKind.INVALID_REQUEST
    details: Mapping[str, int] = MappingProxyType({})  # numbers a client may read (llama-server's extra fields)

    @property
    def message(self) -> str:
        return str(self)


class EngineError(UbatchError):
    """An error whose kind is decided where it is raised (the server's engine: a request that
    does not fit, a failed decode, a server shutting down)."""

    def __init__(self, kind: ErrorKind, message: str, **details: int) -> None:
        super().__init__(message)
        self.kind, self.details = kind, details


class EngineDown(UbatchError):
    """The engine itself cannot go on (a tensor-parallel rank is gone): the server answers what it
    holds with 503 and exits with this line."""

    kind = ErrorKind.UNAVAILABLE


class ModelLoadError(UbatchError):
    """The model file is missing, not GGUF, truncated, or uses something we do not support."""


class ContextError(UbatchError):
    """A request does not fit the context (prompt too long, batch too large, bad sequence id)."""


class TensorParallelError(ContextError):
    """Tensor parallelism cannot start as asked (too few ranks or devices, ranks that do not meet):
    a set-up fault, told apart from a context that does not fit; a rank lost while running is
    `EngineDown` (engine/parallel/group.py `RankLost`)."""


def allocate(what: str, nbytes: int, fn: Callable[[], T]) -> T:
    """Run an allocation; on failure say which buffer and how large (llama.cpp names it too)."""
    try:
        return fn()
    except (RuntimeError, MemoryError) as e:
        raise ContextError(
            f"failed to allocate the {what} ({nbytes / 2**20:.2f} MiB): {str(e).splitlines()[0][:120]}; lower -c, -ub or -np (see `ubatch info --fit`)"
        ) from None
