"""The hook a context tells its work through before doing it (tensor parallelism's rank 0).

A `Context` and its `MirroredMemory` send nothing themselves: before building, before each
decode and before each KV cell operation they hand the message (engine/context/messages.py) to
their `Announce`, and do the work inside the `with` it returns, so the message and the
collectives it starts are one step of the channel. A context of one process has no hook (None)
and pays nothing per step. `OnChannel` is rank 0's hook over the model's channel; tests record
messages with their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

from ubatch.engine.context.messages import Message
from ubatch.engine.model.shard import Channel


class Announce(Protocol):
    def __call__(self, msg: Message) -> AbstractContextManager[None]:
        """`msg` told; the work it announces runs inside the returned `with`."""

    def dropped(self, key: int) -> None:
        """Context `key` is gone (a finalizer may call this in the middle of a step)."""


class OnChannel:
    """Rank 0's hook: each message sent while holding the channel's turn for the work it starts."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    @contextmanager
    def __call__(self, msg: Message) -> Iterator[None]:
        with self.channel.turn():
            self.channel.send(msg)
            yield

    def dropped(self, key: int) -> None:
        self.channel.release(key)
