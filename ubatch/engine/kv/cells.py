"""The cells of one KV stream: for each cell a position (-1 = empty) and a set of sequence ids.

Plain numpy bookkeeping, no tensors: which cells a ubatch goes to, what the mask lets each query
see, and the sequence operations (rm / cp / keep / add / div) all come from these arrays.

A decode step asks for the same few reductions of them (cells used, past the last used one, any
shift pending, a sequence's last position), each an O(size) pass; they are kept between steps
and brought up to date by the one-cell placement of a decode row (`put_one`). Any other change
to the arrays calls `touch`, and the next question recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class KVCells:
    size: int
    n_seq_max: int
    pos: np.ndarray = field(init=False)  # int64 [size]
    seq: np.ndarray = field(init=False)  # bool [size, n_seq_max]
    shift: np.ndarray = field(init=False)  # int64 [size]: position delta not yet applied to K
    head: int = 0
    # the reductions a step asks for, kept while the arrays hold still (None: not known)
    _used: int | None = field(default=None, init=False, repr=False, compare=False)
    _used_max_p1: int | None = field(default=None, init=False, repr=False, compare=False)
    _has_shift: bool | None = field(default=None, init=False, repr=False, compare=False)
    _pos_max: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.pos = np.full(self.size, -1, dtype=np.int64)
        self.seq = np.zeros((self.size, self.n_seq_max), dtype=bool)
        self.shift = np.zeros(self.size, dtype=np.int64)

    def copy(self) -> KVCells:
        c = KVCells.__new__(KVCells)
        c.size, c.n_seq_max, c.head = self.size, self.n_seq_max, self.head
        c.pos, c.seq, c.shift = self.pos.copy(), self.seq.copy(), self.shift.copy()
        c._used, c._used_max_p1, c._has_shift = self._used, self._used_max_p1, self._has_shift
        c._pos_max = dict(self._pos_max)
        return c

    def touch(self) -> None:
        """The arrays changed other than by `put_one`: the kept reductions are recomputed when next asked."""
        self._used = self._used_max_p1 = self._has_shift = None
        self._pos_max.clear()

    def put_one(self, cell: int, pos: int, seq_ids: list[int]) -> None:
        """A decode row into an empty cell, the kept reductions brought up to date (no pass)."""
        self.pos[cell] = pos
        self.seq[cell, seq_ids] = True
        if self._used is not None:
            self._used += 1
        if self._used_max_p1 is not None:
            self._used_max_p1 = max(self._used_max_p1, cell + 1)
        for s in seq_ids:  # an empty cell's shift is 0: `_has_shift` holds
            if (p := self._pos_max.get(s)) is not None:
                self._pos_max[s] = max(p, pos)
        self.head = cell + 1

    @property
    def used(self) -> int:
        if self._used is None:
            self._used = int((self.pos >= 0).sum())
        return self._used

    @property
    def used_max_p1(self) -> int:
        if self._used_max_p1 is None:
            last = self.size - int(np.argmax(self.pos[::-1] >= 0))  # past the last used cell, if any is
            self._used_max_p1 = last if self.pos[last - 1] >= 0 else 0
        return self._used_max_p1

    @property
    def has_shift(self) -> bool:
        if self._has_shift is None:
            self._has_shift = bool(self.shift.any())
        return self._has_shift

    @property
    def n_shared(self) -> int:
        """Cells held by more than one sequence: a prefix stored once for several."""
        return int((self.seq.sum(1) > 1).sum())

    def held_apart(self, s: int, others: list[int], p0: int = -1, p1: int = -1) -> np.ndarray:
        """Cells in [p0, p1) that s holds and none of `others` does: what removing s frees."""
        sel = self._range(p0, p1) & self.seq[:, s]
        return sel & ~self.seq[:, others].any(1) if others else sel

    def shared_of(self, s: int, p0: int, p1: int) -> np.ndarray:
        """Cells in [p0, p1) that sequence s holds together with another sequence: what a change
        to s alone (seq_add, seq_div) must first separate, so the others' view stays put."""
        return self._range(p0, p1) & self.seq[:, s] & (self.seq.sum(1) > 1)

    def seq_pos_max(self, s: int) -> int:
        x = self._pos_max.get(s)
        if x is None:
            p = self.pos[self.seq[:, s]]
            x = self._pos_max[s] = int(p.max()) if p.size else -1
        return x

    def seq_pos_max_all(self) -> np.ndarray:
        """seq_pos_max of every sequence at once, int64 [n_seq_max] (-1: no cell)."""
        return np.where(self.seq, self.pos[:, None], -1).max(0, initial=-1)

    def seq_pos_min(self, s: int) -> int:
        p = self.pos[self.seq[:, s]]
        return int(p.min()) if p.size else -1

    def clear(self) -> None:
        self.pos[:] = -1
        self.seq[:] = False
        self.shift[:] = 0
        self.head = 0
        self.touch()

    def free(self, sel: np.ndarray) -> None:
        self.pos[sel] = -1
        self.seq[sel] = False
        self.shift[sel] = 0
        self.touch()

    def _move_head_back(self) -> None:
        free = np.flatnonzero(self.pos < 0)
        if free.size and free[0] < self.head:
            self.head = int(free[0])

    def _range(self, p0: int, p1: int) -> np.ndarray:
        p0 = max(p0, 0)
        p1 = np.iinfo(np.int64).max if p1 < 0 else p1
        return (self.pos >= p0) & (self.pos < p1)

    def seq_rm(self, s: int, p0: int, p1: int) -> None:
        sel = self._range(p0, p1)
        if s < 0:
            self.free(sel)
        else:
            sel &= self.seq[:, s]
            self.seq[sel, s] = False
            self.touch()
            self.free(sel & ~self.seq.any(1))
        self._move_head_back()

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Share cells: the destination sequence sees the source's cells, no data is copied."""
        self.seq[self._range(p0, p1) & self.seq[:, src], dst] = True
        self.touch()

    def seq_keep(self, s: int) -> None:
        keep = self.seq[:, s].copy()
        self.free(~keep)
        self.seq[keep] = False
        self.seq[keep, s] = True
        self.touch()
        self._move_head_back()

    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        if delta == 0:
            return
        sel = self._range(p0, p1) & self.seq[:, s]
        self.pos[sel] += delta
        self.shift[sel] += delta
        self.touch()
        gone = sel & (self.pos < 0)
        self.free(gone)
        if gone.any():
            self.head = int(np.flatnonzero(gone)[0])
        else:
            self.head = 0

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        if d == 1:
            return
        sel = self._range(p0, p1) & self.seq[:, s]
        old = self.pos[sel]
        new = old // d
        self.pos[sel] = new
        self.shift[sel] += new - old  # K must be rotated from old to new position
        self.touch()
