"""The KV cache as llama.cpp models it: streams of cells plus per-layer K and V storage.

A unified cache has one stream shared by every sequence; otherwise sequence s owns stream s
(n_ctx_seq cells each). A ubatch is placed cell by cell (`find_slot`, `apply_ubatch`);
attention then reads cells [0, n_kv) of its streams through a mask that hides empty cells,
other sequences, future positions and, in a sliding-window cache, positions outside the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from ubatch.engine.batch import UBatch
from ubatch.engine.errors import ContextError, allocate
from ubatch.engine.kv.cells import KVCells
from ubatch.engine.params import KV_TYPES, round_up
from ubatch.kernels.ops import KVTensor

N_KV_PAD = 256  # n_kv grows in steps of 256 cells so graph shapes repeat


class NoCellsError(ContextError):
    """A sequence operation needs free cells (to separate shared cells, or to copy a prefix into
    another stream) and the stream has too few; nothing was changed."""


def as_mask(visible: np.ndarray) -> np.ndarray:
    """A visibility array as the additive float16 mask attention adds: 0 or -inf."""
    return np.where(visible, np.float16(0.0), np.float16(-np.inf))


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of a row of n values in a cache type: ggml's (n / block) * type_size."""
    block, size = GGML_QUANT_SIZES[T(KV_TYPES[type_name][0])]
    return n // block * size


@dataclass(slots=True)
class KVCacheInfo:
    """What a startup log says about one cache."""

    name: str  # "" for a plain cache, "non-SWA" / "SWA" for the iSWA pair
    size: int  # cells per stream
    n_stream: int
    n_layer: int
    n_seq_max: int
    type_k: str
    type_v: str
    k_bytes: int
    v_bytes: int


class KVStore(KVTensor):
    """One layer's K or V rows for all cells of all streams, in the cache type; the backend's
    kv_store / kv_chunk / kv_rows read and write it."""

    def __init__(self, n_cells: int, n_head: int, head_dim: int, type_name: str, device: torch.device | str) -> None:
        ggml_type, dtype = KV_TYPES[type_name]
        nbytes = n_cells * row_bytes(type_name, n_head * head_dim)
        row = row_bytes(type_name, n_head * head_dim)

        def make() -> torch.Tensor:
            if dtype is not None:
                return torch.zeros(n_cells, n_head, head_dim, dtype=dtype, device=device)
            return torch.zeros(n_cells, row, dtype=torch.uint8, device=device)  # quantised rows as bytes

        super().__init__(allocate("KV cache", nbytes, make), int(ggml_type), n_head, head_dim)


class KVCache:
    def __init__(
        self,
        layers: list[int],
        size: int,
        n_stream: int,
        n_seq_max: int,
        n_head_kv: int,
        head_k: int,
        head_v: int,
        type_k: str = "f16",
        type_v: str = "f16",
        n_swa: int = 0,
        device: torch.device | str = "cpu",
        name: str = "",
        cells: bool = True,  # False: sizes only (device "meta"), nothing to place into
    ) -> None:
        for t in (type_k, type_v):
            if t not in KV_TYPES:
                raise ContextError(f"unsupported KV cache type {t!r}; use one of {', '.join(KV_TYPES)}")
        self.name, self.layers, self.size, self.n_stream = name, layers, size, n_stream
        self.n_seq_max, self.n_swa, self.type_k, self.type_v = n_seq_max, n_swa, type_k, type_v
        self.head_k, self.head_v, self.n_head_kv = head_k, head_v, n_head_kv
        self.streams = [KVCells(size, n_seq_max) for _ in range(n_stream)] if cells else []
        n = size * n_stream
        self.k = {il: KVStore(n, n_head_kv, head_k, type_k, device) for il in layers}
        self.v = {il: KVStore(n, n_head_kv, head_v, type_v, device) for il in layers}
        self.pending_copies: list[tuple[int, int]] = []  # (src stream, dst stream) at next update
        # while a batch with drafted rows is placed: per sequence, its first row's position. A
        # window cell is reused only if that row cannot see it either, so removing rejected
        # drafts never leaves the next row without a key it needs
        self.window_floor: dict[int, int] = {}

    def stream_of(self, s: int) -> int:
        return 0 if self.n_stream == 1 else s

    # -- accounting ---------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return sum(c.used for c in self.streams)

    def info(self) -> KVCacheInfo:
        n = len(self.layers) * self.size * self.n_stream
        return KVCacheInfo(
            self.name,
            self.size,
            self.n_stream,
            len(self.layers),
            self.n_seq_max,
            self.type_k,
            self.type_v,
            n * row_bytes(self.type_k, self.n_head_kv * self.head_k),
            n * row_bytes(self.type_v, self.n_head_kv * self.head_v),
        )

    def n_kv_of(self, streams: list[int]) -> int:
        """Cells attention looks at: used_max_p1 rounded up to 256, at least 256, at most size."""
        used = max(self.streams[s].used_max_p1 for s in streams)
        return min(self.size, max(N_KV_PAD, round_up(used, N_KV_PAD)))

    def seq_pos_max(self, s: int) -> int:
        return self.streams[self.stream_of(s)].seq_pos_max(s)

    def seq_pos_min(self, s: int) -> int:
        return self.streams[self.stream_of(s)].seq_pos_min(s)

    def masked_swa(self, p0: np.ndarray, p1: np.ndarray) -> np.ndarray:
        """STANDARD sliding window: key p0 is outside query p1's window when p1 - p0 >= n_swa."""
        if self.n_swa <= 0:
            return np.zeros(np.broadcast(p0, p1).shape, dtype=bool)
        return (p1 - p0) >= self.n_swa

    # -- placing a ubatch -----------------------------------------------------------------------
    def ubatch_streams(self, ub: UBatch) -> list[int]:
        """The stream of each sequence group of the ubatch (one group when unified)."""
        if self.n_stream == 1:
            return [0]
        return ub.seq_id0[:: ub.n_tokens // ub.n_seqs].tolist()  # stream s holds sequence s

    def find_slot(self, ub: UBatch) -> np.ndarray | None:
        """Global cell index for each slot (stream * size + cell), or None if there is no room."""
        streams = self.ubatch_streams(ub)
        per = ub.n_tokens // len(streams)
        out = []
        for s in streams:
            cells = self._find_in_stream(self.streams[s], per)
            if cells is None:
                return None
            out.append(cells + s * self.size if s else cells)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _find_in_stream(self, c: KVCells, n: int) -> np.ndarray | None:
        """Scan from head, wrapping, for empty cells or single-sequence cells the window left."""
        if n > c.size:
            return None
        head = c.head if c.head <= c.used + 2 * n else 0
        if n == 1 and head < c.size and self._usable_one(c, head):  # a decode step's row: the scan's first find
            return np.array([head], dtype=np.int64)
        return self._scan(c, n, head)

    def _usable_one(self, c: KVCells, cell: int) -> bool:
        """Whether the scan would take `cell`: empty, or (SWA, no drafts) left by every holder's
        window. Once a sliding-window cache has wrapped, that is the head cell at every decode
        step, answered from the holders' kept last positions instead of a pass over the stream."""
        p = int(c.pos[cell])
        if p < 0:
            return True
        if self.n_swa <= 0 or self.window_floor:
            return False
        return all(c.seq_pos_max(s) + 1 - p >= self.n_swa for s in np.flatnonzero(c.seq[cell]).tolist())

    def _scan(self, c: KVCells, n: int, head: int) -> np.ndarray | None:
        usable = c.pos < 0
        if self.n_swa > 0:  # a cell every holder's window has left (a shared one too)
            first = c.seq_pos_max_all() + 1
            for s, p in self.window_floor.items():
                first[s] = min(first[s], p)
            needed = c.seq & ~self.masked_swa(c.pos[:, None], first[None, :])
            usable |= (c.pos >= 0) & ~needed.any(1)
        after = np.flatnonzero(usable[head:])
        if after.size >= n:
            return after[:n] + head
        cand = np.concatenate([after + head, np.flatnonzero(usable[:head])])
        return cand[:n] if cand.size >= n else None

    def apply_ubatch(self, ub: UBatch, slots: np.ndarray) -> None:
        """Write the ubatch into the cells `find_slot` gave it: group g's rows into its stream."""
        streams = self.ubatch_streams(ub)
        if streams == [0]:  # one group in the first stream: the ubatch as it is
            self._apply_stream(self.streams[0], slots, ub.pos, ub.seq_id, ub.seq_id0)
            return
        per = ub.n_tokens // len(streams)
        for g, s in enumerate(streams):
            r = slice(g * per, (g + 1) * per)
            self._apply_stream(self.streams[s], slots[r] - s * self.size, ub.pos[r], ub.seq_id[r], ub.seq_id0[r])

    @staticmethod
    def _apply_stream(
        c: KVCells, cells: np.ndarray, pos: np.ndarray, seq_ids: list[list[int]], seq0: np.ndarray
    ) -> None:
        if cells.size == 1 and c.pos[cell := int(cells[0])] < 0:  # a decode step's row into an empty cell
            c.put_one(cell, int(pos[0]), seq_ids[0])
            return
        lost: dict[int, int] = {}
        for cell in cells[c.pos[cells] >= 0].tolist():  # reused cells (SWA): whose positions go
            for s in np.flatnonzero(c.seq[cell]).tolist():
                lost[s] = max(lost.get(s, -1), int(c.pos[cell]))
        c.free(cells)
        c.pos[cells] = pos
        c.seq[cells, seq0] = True
        for cell, sids in zip(cells, seq_ids):
            if len(sids) > 1:
                c.seq[cell, sids] = True
        c.touch()
        if lost:
            placed = np.zeros(c.size, dtype=bool)
            placed[cells] = True
            for s, p in lost.items():  # keep each sequence's positions contiguous
                sel = c.seq[:, s] & (c.pos <= p) & ~placed
                c.seq[sel, s] = False
                c.free(sel & ~c.seq.any(1))
        c.head = int(cells[-1]) + 1

    # -- what a ubatch's attention sees -------------------------------------------------------
    def visible(self, ub: UBatch, streams: list[int], n_kv: int, causal: bool = True) -> np.ndarray:
        """Which cells each query sees, bool [n_groups, n_tokens / n_groups, n_kv].

        A query sees a cell that is not empty, holds the query's first sequence id, is not in
        its future (unless not `causal`), and (SWA) is inside its window.
        """
        per = ub.n_tokens // len(streams)
        out = np.empty((len(streams), per, n_kv), dtype=bool)
        for g, s in enumerate(streams):
            c, vis = self.streams[s], out[g]
            pos = c.pos[:n_kv]
            if per == 1:  # a decode row: compared with its position as a number
                q = int(ub.pos[g])
                lo = max(q - self.n_swa, -1) if self.n_swa > 0 else -1  # at or below: empty or out of the window
                np.logical_and(pos > lo, c.seq[:n_kv, int(ub.seq_id0[g])], out=vis[0])
                if causal:
                    vis[0] &= pos <= q
                continue
            rows = slice(g * per, (g + 1) * per)
            p1 = ub.pos[rows, None]
            np.logical_and(pos >= 0, c.seq[:n_kv, ub.seq_id0[rows]].T, out=vis)
            if causal:
                vis &= pos <= p1
            if self.n_swa > 0:
                vis &= ~self.masked_swa(pos, p1)
        return out

    def mask(self, ub: UBatch, streams: list[int], n_kv: int, causal: bool = True) -> np.ndarray:
        """The additive mask [n_groups, n_tokens / n_groups, n_kv] of `visible`: 0 = visible,
        -inf = hidden (both exact in float16)."""
        return as_mask(self.visible(ub, streams, n_kv, causal))

    # -- state for prepare() --------------------------------------------------------------------
    def snapshot(self) -> list[KVCells]:
        return [c.copy() for c in self.streams]

    def restore(self, snap: list[KVCells]) -> None:
        self.streams = snap

    # -- sequence operations (p0 < 0 -> 0, p1 < 0 -> infinity, range [p0, p1)) -------------------
    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        for i, c in enumerate(self.streams):
            if s < 0 or self.stream_of(s) == i:
                c.seq_rm(s, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Unified: dst joins src's cells in [p0, p1) (shared, nothing copied). Between streams:
        a whole sequence is copied stream to stream at the next update (llama.cpp); a range is
        copied now, row by row on the device, into free cells of dst's stream."""
        a, b = self.stream_of(src), self.stream_of(dst)
        if a == b:
            self.streams[a].seq_cp(src, dst, p0, p1)
            return
        if p0 > 0 or p1 >= 0:
            self._copy_range(src, dst, p0, p1)
            return
        dst_cells = self.streams[b]
        dst_cells.clear()
        src_cells = self.streams[a]
        sel = src_cells.seq[:, src]
        dst_cells.pos[sel] = src_cells.pos[sel]
        dst_cells.seq[sel, dst] = True
        dst_cells.shift[sel] = src_cells.shift[sel]
        dst_cells.touch()
        dst_cells.head = src_cells.head
        self.pending_copies.append((a, b))  # the K/V bytes move at the next update()

    def seq_keep(self, s: int) -> None:
        for i, c in enumerate(self.streams):
            if self.stream_of(s) == i:
                c.seq_keep(s)
            else:
                c.clear()

    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        if delta:
            self.separate(s, p0, p1)
        self.streams[self.stream_of(s)].seq_add(s, p0, p1, delta)

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        if d != 1:
            self.separate(s, p0, p1)
        self.streams[self.stream_of(s)].seq_div(s, p0, p1, d)

    # -- shared cells ---------------------------------------------------------------------------
    @property
    def n_shared(self) -> int:
        return sum(c.n_shared for c in self.streams)

    def n_free(self, s: int) -> int:
        return int((self.streams[self.stream_of(s)].pos < 0).sum())

    def n_to_separate(self, s: int, p0: int, p1: int) -> int:
        """Free cells `separate(s, p0, p1)` would take."""
        return int(self.streams[self.stream_of(s)].shared_of(s, p0, p1).sum())

    def separate(self, s: int, p0: int, p1: int) -> None:
        """Give sequence s its own copy of the cells in [p0, p1) it shares with others (rows
        copied on the device), so a change to s alone leaves every other sequence's view as it
        was. Raises NoCellsError, changing nothing, when the stream has too few free cells."""
        st = self.stream_of(s)
        c = self.streams[st]
        old = np.flatnonzero(c.shared_of(s, p0, p1))
        if old.size == 0:
            return
        new = np.flatnonzero(c.pos < 0)[: old.size]
        if new.size < old.size:
            raise NoCellsError(f"no room to separate {old.size} shared cells of sequence {s} ({new.size} free)")
        self.apply_copies()
        c.pos[new], c.shift[new] = c.pos[old], c.shift[old]
        c.seq[new, s], c.seq[old, s] = True, False
        c.touch()
        self._copy_rows(old + st * self.size, new + st * self.size)

    def can_copy_range(self, src: int, dst: int, p0: int, p1: int) -> bool:
        """Whether `seq_cp(src, dst, p0, p1)` finds the cells it needs (always, when shared)."""
        a, b = self.stream_of(src), self.stream_of(dst)
        if a == b:
            return True
        sc, dc = self.streams[a], self.streams[b]
        need = int((sc._range(p0, p1) & sc.seq[:, src]).sum())
        mine = dc._range(p0, p1) & dc.seq[:, dst] & (dc.seq.sum(1) == 1)
        return need <= int((dc.pos < 0).sum() + mine.sum())

    def _copy_range(self, src: int, dst: int, p0: int, p1: int) -> None:
        a, b = self.stream_of(src), self.stream_of(dst)
        sc, dc = self.streams[a], self.streams[b]
        if not self.can_copy_range(src, dst, p0, p1):
            raise NoCellsError(f"no room in stream {b} to copy sequence {src}'s cells [{p0}, {p1})")
        self.apply_copies()
        dc.seq_rm(dst, p0, p1)
        old = np.flatnonzero(sc._range(p0, p1) & sc.seq[:, src])
        new = np.flatnonzero(dc.pos < 0)[: old.size]
        dc.pos[new], dc.shift[new] = sc.pos[old], sc.shift[old]
        dc.seq[new, dst] = True
        dc.touch()
        if new.size:
            dc.head = int(new[-1]) + 1 if new[-1] + 1 < dc.size else 0
        self._copy_rows(old + a * self.size, new + b * self.size)

    def _copy_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """K and V rows src -> dst (global cell indices) in every layer, on the storage's device."""
        if src.size == 0:
            return
        si, di = torch.from_numpy(src), torch.from_numpy(dst)
        for store in (*self.k.values(), *self.v.values()):
            d = store.data
            d[di.to(d.device)] = d.index_select(0, si.to(d.device))

    def apply_copies(self) -> bool:
        """Move the K/V bytes of queued whole-stream copies; True if there were any."""
        did = bool(self.pending_copies)
        for a, b in self.pending_copies:
            for store in (*self.k.values(), *self.v.values()):
                store.data[b * self.size : (b + 1) * self.size] = store.data[a * self.size : (a + 1) * self.size]
        self.pending_copies.clear()
        return did

    def clear(self) -> None:
        for c in self.streams:
            c.clear()
        self.pending_copies.clear()

    @property
    def has_shift(self) -> bool:
        return any(c.has_shift for c in self.streams)
