"""Rank 0's side of tensor parallelism inside a context: every change to the KV memory and every
decode is announced to the other ranks before it runs (through the context's hook,
engine/context/announce.py), so each rank's cells stay the same as rank
0's and each rank runs the same forward passes on its shard (the ranks' loop: engine/parallel)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ubatch.engine.context.announce import Announce
from ubatch.engine.context.messages import MemoryOp
from ubatch.engine.kv.memory import KVMemory

# the KV memory's operations a caller outside the context may apply, by the name a message carries
MEMORY_OPS: dict[str, Callable[..., None]] = {
    "seq_rm": KVMemory.seq_rm,
    "seq_cp": KVMemory.seq_cp,
    "seq_cp_past": KVMemory.seq_cp_past,
    "seq_keep": KVMemory.seq_keep,
    "seq_add": KVMemory.seq_add,
    "seq_div": KVMemory.seq_div,
    "separate": KVMemory.separate,
    "clear": KVMemory.clear,
}


class MirroredMemory(KVMemory):
    """KV memory whose sequence operations are announced (to the other ranks) first, through
    the context's hook. An operation that calls another (seq_add separating shared cells) is
    announced once, as the outer call, which holds the turn for the inner ones."""

    announce: Announce
    key: int
    _depth: int = 0

    def attach(self, announce: Announce, key: int) -> MirroredMemory:
        self.announce, self.key = announce, key
        return self

    @contextmanager
    def _announced(self, name: str, *args: int) -> Iterator[None]:
        if self._depth:
            yield
            return
        with self.announce(MemoryOp(self.key, name, args)):
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1

    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        with self._announced("seq_rm", s, p0, p1):
            super().seq_rm(s, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        with self._announced("seq_cp", src, dst, p0, p1):
            super().seq_cp(src, dst, p0, p1)

    def seq_cp_past(self, src: int, dst: int, n_past: int, p1: int) -> None:
        with self._announced("seq_cp_past", src, dst, n_past, p1):
            super().seq_cp_past(src, dst, n_past, p1)

    def seq_keep(self, s: int) -> None:
        with self._announced("seq_keep", s):
            super().seq_keep(s)

    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        with self._announced("seq_add", s, p0, p1, delta):
            super().seq_add(s, p0, p1, delta)

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        with self._announced("seq_div", s, p0, p1, d):
            super().seq_div(s, p0, p1, d)

    def separate(self, s: int, p0: int = -1, p1: int = -1) -> None:
        with self._announced("separate", s, p0, p1):
            super().separate(s, p0, p1)

    def clear(self) -> None:
        with self._announced("clear"):
            super().clear()
