"""The workspace layout: give every intermediate tensor of a graph an offset in one buffer.

In the spirit of ggml-alloc: walk the nodes in execution order, allocate each output when it
is produced (reusing an input's memory in place when the op allows it and that input dies
here), release each tensor after its last use, and place new tensors in the best-fitting free
block. Tensors whose lifetimes do not overlap share memory; the buffer's size is the peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALIGN = 64  # bytes: every tensor starts cache-line aligned (and aligned for any dtype view)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(slots=True)
class Request:
    """One tensor to place: alive from step `first` to step `last` (inclusive)."""

    key: int
    size: int
    first: int
    last: int
    inplace_of: int | None = None  # key of an input whose memory this output may take over


@dataclass(slots=True)
class Layout:
    offsets: dict[int, int]
    size: int  # bytes of the buffer (the peak of live bytes, plus fragmentation)
    peak_step: int  # step at which the buffer reached its size
    live_at_peak: list[int] = field(default_factory=list)  # keys alive at that step


class _FreeList:
    def __init__(self) -> None:
        self.blocks: list[tuple[int, int]] = []  # (offset, size), sorted, coalesced
        self.end = 0  # high-water mark

    def alloc(self, size: int) -> int:
        best = None
        for i, (_, sz) in enumerate(self.blocks):
            if sz >= size and (best is None or sz < self.blocks[best][1]):
                best = i
        if best is not None:
            off, sz = self.blocks[best]
            if sz == size:
                self.blocks.pop(best)
            else:
                self.blocks[best] = (off + size, sz - size)
            return off
        if self.blocks and self.blocks[-1][0] + self.blocks[-1][1] == self.end:
            off, sz = self.blocks.pop()  # grow the last free block at the end
            self.end = off + size
            return off
        off = self.end
        self.end += size
        return off

    def free(self, off: int, size: int) -> None:
        self.blocks.append((off, size))
        self.blocks.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self.blocks:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self.blocks = merged


def lay_out(requests: list[Request]) -> Layout:
    """Offsets for every request; requests must be ordered by `first`."""
    fl = _FreeList()
    offsets: dict[int, int] = {}
    sizes = {r.key: align(r.size) for r in requests}
    owner: dict[int, int] = {}  # key -> key that owns its memory (in-place chains)
    dying: dict[int, list[int]] = {}
    for r in requests:
        dying.setdefault(r.last, []).append(r.key)
    live: set[int] = set()
    peak, peak_step = 0, 0
    live_at_peak: list[int] = []
    steps = sorted({r.first for r in requests} | set(dying))
    by_first: dict[int, list[Request]] = {}
    for r in requests:
        by_first.setdefault(r.first, []).append(r)
    for step in steps:
        for r in by_first.get(step, []):
            src = r.inplace_of
            if (
                src is not None
                and src in live
                and src in dying.get(step, [])
                and sizes[src] >= sizes[r.key]
                and owner.get(src, src) == src
            ):
                offsets[r.key] = offsets[src]
                owner[src] = r.key  # memory passes to the output; freed when it dies
                sizes[r.key] = sizes[src]
            else:
                offsets[r.key] = fl.alloc(sizes[r.key])
            live.add(r.key)
        in_use = sum(sizes[k] for k in live if owner.get(k, k) == k)
        if fl.end > peak or (fl.end == peak and in_use > sum(sizes[k] for k in live_at_peak)):
            peak, peak_step, live_at_peak = fl.end, step, sorted(k for k in live if owner.get(k, k) == k)
        for k in dying.get(step, []):
            live.discard(k)
            if owner.get(k, k) == k:
                fl.free(offsets[k], sizes[k])
    return Layout(offsets, fl.end, peak_step, live_at_peak)
