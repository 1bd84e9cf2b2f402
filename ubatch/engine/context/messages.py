"""What rank 0 tells the other ranks under tensor parallelism: one dataclass per message.

Rank 0 announces each model it loads, each context it builds, each decode and each KV cell
operation, and the end; the others do the same on their shards (engine/parallel/worker.py).
Every model and context carries an explicit key, handed out here by rank 0, that the messages
name it by. The messages are plain, picklable values (they cross processes by pickle over the
control group); a rank that receives anything else stops with one line.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ubatch.engine.batch import Batch
from ubatch.engine.params import ContextParams

_keys = itertools.count(1)


def new_key() -> int:
    """A key for a model or context rank 0 announces: unique in this process."""
    return next(_keys)


@dataclass(frozen=True, slots=True)
class LoadModel:
    """Load the GGUF file at `path` and cut this rank's shard of it onto `device`."""

    key: int
    path: str
    device: str


@dataclass(frozen=True, slots=True)
class NewContext:
    """Build a context on model `model` (rank 0 may refuse it; then every rank did)."""

    key: int
    model: int
    params: ContextParams | None
    embeddings: bool
    pooling: str | None


@dataclass(frozen=True, slots=True)
class Decode:
    """Run `batch` on context `key` (its embeddings flag as rank 0's)."""

    key: int
    batch: Batch
    embeddings: bool


@dataclass(frozen=True, slots=True)
class MemoryOp:
    """Apply a KV memory operation (engine/context/mirror.py `MEMORY_OPS`) to context `key`."""

    key: int
    op: str
    args: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DropContext:
    """Context `key` was freed on rank 0."""

    key: int


@dataclass(frozen=True, slots=True)
class Stop:
    """The run ends: leave the loop."""


Message = LoadModel | NewContext | Decode | MemoryOp | DropContext | Stop
