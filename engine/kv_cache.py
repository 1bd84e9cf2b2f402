"""The KV cache as llama.cpp models it: cells holding a position and a set of sequence ids.

Each cell stores one token's K and V for every layer the cache serves. A ubatch is placed into
cells (`find_slot`, `apply_ubatch`); attention then reads cells [0, n_kv) through a mask that
hides empty cells, other sequences, future positions and (SWA caches) positions outside the
window. Gemma 3 uses a pair of such caches (iSWA): one for its global layers sized n_ctx, one for
its sliding-window layers sized for the window only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batch import UBatch
from .errors import ContextError

N_KV_PAD = 256  # n_kv grows in steps of 256 cells so graph shapes repeat

KV_TYPES: dict[str, torch.dtype] = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0}


def round_up(x: int, n: int) -> int:
    return -(-x // n) * n


@dataclass(slots=True)
class KVCacheInfo:
    """What a startup log says about one cache."""

    name: str  # "" for a plain cache, "non-SWA" / "SWA" for the iSWA pair
    size: int  # cells
    n_layer: int
    n_seq_max: int
    type_k: str
    type_v: str
    k_bytes: int
    v_bytes: int


class KVCache:
    def __init__(self, layers: list[int], size: int, n_seq_max: int, n_head_kv: int,
                 head_k: int, head_v: int, type_k: str = "f16", type_v: str = "f16",
                 n_swa: int = 0, device: torch.device | str = "cpu", name: str = "") -> None:
        if type_k not in KV_TYPES or type_v not in KV_TYPES:
            raise ContextError(f"KV cache type {type_k}/{type_v} not supported; use one of {list(KV_TYPES)}")
        self.name, self.layers, self.size, self.n_seq_max = name, layers, size, n_seq_max
        self.n_swa, self.type_k, self.type_v = n_swa, type_k, type_v
        self.pos = np.full(size, -1, dtype=np.int64)
        self.seq = np.zeros((size, n_seq_max), dtype=bool)
        self.head = 0
        self.k = {il: torch.zeros(size, n_head_kv, head_k, dtype=KV_TYPES[type_k], device=device)
                  for il in layers}
        self.v = {il: torch.zeros(size, n_head_kv, head_v, dtype=KV_TYPES[type_v], device=device)
                  for il in layers}
        self._row_k, self._row_v = n_head_kv * head_k, n_head_kv * head_v

    # -- accounting ---------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return int((self.pos >= 0).sum())

    @property
    def used_max_p1(self) -> int:
        nz = np.flatnonzero(self.pos >= 0)
        return int(nz[-1]) + 1 if nz.size else 0

    @property
    def n_kv(self) -> int:
        return min(self.size, max(N_KV_PAD, round_up(self.used_max_p1, N_KV_PAD)))

    def info(self) -> KVCacheInfo:
        n = len(self.layers) * self.size
        return KVCacheInfo(self.name, self.size, len(self.layers), self.n_seq_max, self.type_k,
                           self.type_v, int(n * self._row_k * KV_TYPE_BYTES[self.type_k]),
                           int(n * self._row_v * KV_TYPE_BYTES[self.type_v]))

    def seq_pos_max(self, s: int) -> int:
        p = self.pos[self.seq[:, s]]
        return int(p.max()) if p.size else -1

    def seq_pos_min(self, s: int) -> int:
        p = self.pos[self.seq[:, s]]
        return int(p.min()) if p.size else -1

    def is_masked_swa(self, p0: np.ndarray, p1: np.ndarray) -> np.ndarray:
        if self.n_swa <= 0:
            return np.zeros(np.broadcast(p0, p1).shape, dtype=bool)
        return (p1 - p0) >= self.n_swa

    # -- placing a ubatch -----------------------------------------------------------------------
    def find_slot(self, ub: UBatch) -> np.ndarray | None:
        """Cells for the ubatch's tokens, scanning from `head` and wrapping, as llama.cpp does."""
        n = ub.n_tokens
        if n > self.size:
            return None
        head = self.head if self.head <= self.used + 2 * n else 0
        usable = self.pos < 0
        if self.n_swa > 0:
            single = self.seq.sum(1) == 1
            owner = self.seq.argmax(1)
            seq_max = np.array([self.seq_pos_max(s) for s in range(self.n_seq_max)])
            usable |= single & (self.pos >= 0) & self.is_masked_swa(self.pos, seq_max[owner] + 1)
        order = np.roll(np.arange(self.size), -head)
        cand = order[usable[order]]
        return cand[:n] if cand.size >= n else None

    def apply_ubatch(self, ub: UBatch, cells: np.ndarray) -> None:
        lost: dict[int, int] = {}
        for c in cells[self.pos[cells] >= 0]:
            for s in np.flatnonzero(self.seq[c]):
                lost[int(s)] = max(lost.get(int(s), -1), int(self.pos[c]))
        self.pos[cells] = -1
        self.seq[cells] = False
        self.pos[cells] = ub.pos
        for c, sids in zip(cells, ub.seq_id):
            self.seq[c, sids] = True
        for s, p in lost.items():  # keep each sequence's positions contiguous
            self._remove(self.seq[:, s] & (self.pos <= p) & ~np.isin(np.arange(self.size), cells), s)
        self.head = int(cells[-1]) + 1 if cells.size else self.head

    def _remove(self, sel: np.ndarray, s: int) -> None:
        self.seq[sel, s] = False
        self.pos[sel & ~self.seq.any(1)] = -1

    # -- the mask -------------------------------------------------------------------------------
    def mask(self, ub: UBatch, n_kv: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive mask [n_tokens, n_kv]: 0 where the query may see the cell, -inf elsewhere."""
        pos = self.pos[:n_kv][None, :]
        p1 = ub.pos[:, None]
        visible = (pos >= 0) & self.seq[:n_kv][:, ub.seq_id0].T & (pos <= p1)
        visible &= ~self.is_masked_swa(pos, p1)
        m = np.where(visible, 0.0, -np.inf).astype(np.float32)
        return torch.from_numpy(m).to(device)

    # -- sequence operations --------------------------------------------------------------------
    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        p0 = max(p0, 0)
        p1 = np.iinfo(np.int64).max if p1 < 0 else p1
        in_range = (self.pos >= p0) & (self.pos < p1)
        if s < 0:
            sel = in_range & (self.pos >= 0)
            self.seq[sel] = False
            self.pos[sel] = -1
        else:
            self._remove(in_range & self.seq[:, s], s)
        free = np.flatnonzero(self.pos < 0)
        if free.size and free[0] < self.head:
            self.head = int(free[0])

    def clear(self) -> None:
        self.pos[:] = -1
        self.seq[:] = False
        self.head = 0


class KVMemory:
    """The caches of a context and which layer reads which (one cache, or the iSWA pair)."""

    def __init__(self, caches: list[KVCache], layer_cache: list[int]) -> None:
        self.caches, self.layer_cache = caches, layer_cache

    def cache_of(self, il: int) -> KVCache:
        return self.caches[self.layer_cache[il]]

    def seq_pos_max(self, s: int) -> int:
        # llama.cpp's iSWA reports the SWA cache's positions; with no SWA it is the only cache
        return self.caches[-1].seq_pos_max(s)

    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        for c in self.caches:
            c.seq_rm(s, p0, p1)

    def clear(self) -> None:
        for c in self.caches:
            c.clear()

    @property
    def used(self) -> int:
        return self.caches[0].used
