"""A context's KV memory: one cache, or llama.cpp's iSWA pair for sliding-window models.

It decides how a batch is split (split_simple for one stream, split_equal for per-sequence
streams), checks that every ubatch will find cells *before* anything is placed (so a failed
decode leaves the cache unchanged), and applies pending work (stream copies, K-shift) at the
start of a decode.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from ubatch.engine.batch import Batch, RowKind, SplitError, UBatch, split_equal, split_simple
from ubatch.engine.errors import ContextError
from ubatch.engine.kv.cache import KVCache, NoCellsError, round_up
from ubatch.engine.model.hparams import HParams
from ubatch.engine.params import CParams
from ubatch.kernels.ops import Ops


class DecodeStatus(IntEnum):
    """Why llama_decode refused a batch: its return values."""

    NO_KV_SLOT = 1  # no cells for the batch: the caller may free some and retry
    INVALID = -1  # the batch itself is wrong (tokens, positions, sequence ids)
    FAILED = -2  # the cache broke its own promise (a bug)


class DecodeError(ContextError):
    """A batch llama_decode would refuse, with its `DecodeStatus`."""

    def __init__(self, code: DecodeStatus, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class KVMemory:
    def __init__(self, caches: list[KVCache], layer_cache: list[int]) -> None:
        self.caches, self.layer_cache = caches, layer_cache
        self._planned: list[tuple[UBatch, list[np.ndarray]]] = []  # prepared, not yet placed

    @classmethod
    def build(cls, hp: HParams, cp: CParams, device: torch.device | str = "cpu", sizes_only: bool = False) -> KVMemory:
        """Sizes as llama.cpp: n_ctx_seq cells per stream; the SWA cache holds the window for each
        sequence plus one ubatch (or everything with --swa-full). `sizes_only`: shapes without
        storage or cells, for planning (engine/context/reserve.py)."""
        n_stream = 1 if cp.kv_unified else cp.n_seq_max
        dev = "meta" if sizes_only else device

        def cache(layers: list[int], size: int, n_swa: int = 0, name: str = "") -> KVCache:
            # latent attention's V is its K row's latent: no V rows (llama.cpp's K-only cache)
            kv = (hp.n_head_kv, hp.n_embd_head_k, 0 if hp.mla else hp.n_embd_head_v, cp.type_k, cp.type_v)
            return KVCache(layers, size, n_stream, cp.n_seq_max, *kv, n_swa, dev, name, cells=not sizes_only)

        if hp.n_swa <= 0:
            return cls([cache(list(range(hp.n_layer)), cp.n_ctx_seq)], [0] * hp.n_layer)
        base = [il for il in range(hp.n_layer) if not hp.is_swa(il)]
        swa = [il for il in range(hp.n_layer) if hp.is_swa(il)]
        size_swa = (
            cp.n_ctx_seq
            if cp.swa_full
            else round_up(min(cp.n_ctx_seq, hp.n_swa * (cp.n_seq_max if cp.kv_unified else 1) + cp.n_ubatch), 256)
        )
        caches = [cache(base, cp.n_ctx_seq, name="non-SWA"), cache(swa, size_swa, hp.n_swa, "SWA")]
        return cls(caches, [1 if hp.is_swa(il) else 0 for il in range(hp.n_layer)])

    @property
    def n_stream(self) -> int:
        return self.caches[0].n_stream

    @property
    def is_iswa(self) -> bool:
        return len(self.caches) == 2

    @property
    def can_shift(self) -> bool:
        """K-shift needs every cache to hold the same cells (iSWA only with --swa-full)."""
        return len({c.size for c in self.caches}) == 1

    # -- splitting and placement ----------------------------------------------------------------
    def init_batch(self, batch: Batch, n_ubatch: int) -> list[UBatch]:
        """Split as llama.cpp's memory does and check every ubatch fits (error code 1 if not)."""
        floor: dict[int, int] = {}
        if RowKind.DRAFTED in batch.kind:  # a verification: its drafts may be removed again (seq_rm)
            for pos, sids in zip(batch.pos, batch.seq_id):
                for s in sids:
                    floor[s] = min(floor.get(s, pos), pos)
        for c in self.caches:
            c.window_floor = floor
        try:
            return self._init_batch(batch, n_ubatch)
        finally:
            for c in self.caches:
                c.window_floor = {}

    def _init_batch(self, batch: Batch, n_ubatch: int) -> list[UBatch]:
        self._planned = []
        try:
            if self.n_stream == 1:
                ubs = split_simple(batch, n_ubatch)
                if self.prepare(ubs):
                    return ubs
                if self.is_iswa:  # unified iSWA retries with equal splits
                    ubs = split_equal(batch, n_ubatch, sequential=False)
            else:
                ubs = split_equal(batch, n_ubatch, sequential=True)
        except SplitError as e:
            raise DecodeError(DecodeStatus.NO_KV_SLOT, str(e)) from None
        if not self.prepare(ubs):
            used = ", ".join(f"{c.name or 'KV'} {c.used}/{c.size * c.n_stream}" for c in self.caches)
            raise DecodeError(
                DecodeStatus.NO_KV_SLOT,
                f"failed to find a memory slot for batch of size {batch.n_tokens} (cells used: {used}); raise -c or free sequences",
            )
        return ubs

    def prepare(self, ubs: list[UBatch]) -> bool:
        """Find the cells of every ubatch and keep them, so that `place` applies each ubatch
        without searching again. One ubatch (every decode step) is only searched for: the
        search changes no cell. Several: each is placed in turn so the next is searched for in
        the cells it leaves, then the cells are restored exactly as they were."""
        if len(ubs) == 1:
            found = [c.find_slot(ubs[0]) for c in self.caches]
            slots = [sl for sl in found if sl is not None]
            if len(slots) < len(found):
                return False
            self._planned = [(ubs[0], slots)]
            return True
        snaps = [c.snapshot() for c in self.caches]
        planned: list[list[np.ndarray]] = []
        try:
            for ub in ubs:
                per_cache = []
                for c in self.caches:
                    sl = c.find_slot(ub)
                    if sl is None:
                        return False
                    c.apply_ubatch(ub, sl)
                    per_cache.append(sl)
                planned.append(per_cache)
            self._planned = list(zip(ubs, planned))
            return True
        finally:
            for c, s in zip(self.caches, snaps):
                c.restore(s)

    def place(self, ub: UBatch) -> list[np.ndarray]:
        """Apply the next prepared ubatch to the cells (the same cells `prepare` found)."""
        if self._planned and self._planned[0][0] is ub:
            slots = self._planned.pop(0)[1]
            for c, sl in zip(self.caches, slots):
                c.apply_ubatch(ub, sl)
            return slots
        out = []
        for c in self.caches:
            found = c.find_slot(ub)
            if found is None:  # prepare() said it fits; this would be a bug
                raise DecodeError(DecodeStatus.FAILED, "KV slot vanished between prepare and apply")
            c.apply_ubatch(ub, found)
            out.append(found)
        return out

    # -- pending work ----------------------------------------------------------------------------
    def update(self, hp: HParams, ops: Ops, freq_factors: torch.Tensor | None) -> bool:
        """Copy queued streams and re-rotate shifted K; True if any work was done."""
        did = False
        for c in self.caches:
            did = c.apply_copies() or did
        if any(c.has_shift for c in self.caches):
            if not self.can_shift:
                raise ContextError(
                    "the KV cache cannot shift positions with a sliding-window cache smaller than the context; use --swa-full"
                )
            for c in self.caches:
                for s, cells in enumerate(c.streams):
                    idx = np.flatnonzero(cells.shift)
                    if idx.size == 0:
                        continue
                    slots = torch.from_numpy(idx + s * c.size)
                    shift = torch.from_numpy(cells.shift[idx])
                    for il in c.layers:
                        if not hp.has_rope(il):  # its K was stored without rotation
                            continue
                        base, scale = hp.rope_params(il)
                        cos, sin = ops.rope_cache(shift, hp.n_rot, base, scale, freq_factors)
                        store = c.k[il]
                        k = ops.kv_rows(store, slots)
                        # latent attention's row: the RoPE'd part is its tail, the latent stays
                        off = hp.n_embd_head_k - hp.n_rot if hp.mla else 0
                        part = k[..., off:].contiguous()
                        k[..., off:] = ops.rope(part, cos, sin, hp.rope_neox, out=torch.empty_like(part))
                        ops.kv_store(store, slots, k)
                    cells.shift[:] = 0
                    cells.touch()
            did = True
        return did

    # -- sequence operations --------------------------------------------------------------------
    def seq_pos_max(self, s: int) -> int:
        return self.caches[-1].seq_pos_max(s)  # iSWA reports the SWA cache's view

    def seq_pos_min(self, s: int) -> int:
        return self.caches[-1].seq_pos_min(s)

    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        for c in self.caches:
            c.seq_rm(s, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        for c in self.caches:
            c.seq_cp(src, dst, p0, p1)

    def seq_keep(self, s: int) -> None:
        for c in self.caches:
            c.seq_keep(s)

    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        """Shift s's positions in [p0, p1); cells s shares are separated first (every cache
        checked for room before any changes, so NoCellsError leaves the memory as it was)."""
        if delta:
            self._check_separate(s, p0, p1)
        for c in self.caches:
            c.seq_add(s, p0, p1, delta)

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        if d != 1:
            self._check_separate(s, p0, p1)
        for c in self.caches:
            c.seq_div(s, p0, p1, d)

    def n_to_separate(self, s: int, p0: int = -1, p1: int = -1) -> int:
        """Free cells a change to s alone over [p0, p1) would take to separate what it shares."""
        return max(c.n_to_separate(s, p0, p1) for c in self.caches)

    def _check_separate(self, s: int, p0: int, p1: int) -> None:
        for c in self.caches:
            need, free = c.n_to_separate(s, p0, p1), c.n_free(s)
            if need > free:
                raise NoCellsError(f"no room to separate {need} shared cells of sequence {s} ({free} free)")

    def can_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> bool:
        """Whether seq_cp finds its cells: always in a unified cache (cells are shared); between
        streams, enough free cells in dst's for a copy of the range."""
        return all(c.can_copy_range(src, dst, p0, p1) for c in self.caches)

    def seq_cp_past(self, src: int, dst: int, n_past: int, p1: int) -> None:
        """dst keeps its own first n_past positions and takes src's cells over [n_past, p1)
        (seq_cp: shared in a unified cache, copied between streams). In a sliding-window cache
        whose src cells begin above n_past, dst's cells below them go: no later window reaches
        them, and a sequence's window cells stay one run (seq_pos_min says where they start)."""
        for c in self.caches:
            p0 = self._past_start(c, src, n_past)
            if p0 < n_past:
                c.seq_rm(dst, p0, n_past)
            c.seq_cp(src, dst, p0, p1)

    def can_seq_cp_past(self, src: int, dst: int, n_past: int, p1: int) -> bool:
        """Whether `seq_cp_past` finds its cells (as `can_seq_cp`)."""
        return all(c.can_copy_range(src, dst, self._past_start(c, src, n_past), p1) for c in self.caches)

    @staticmethod
    def _past_start(c: KVCache, src: int, n_past: int) -> int:
        return 0 if c.n_swa > 0 and c.seq_pos_min(src) > n_past else n_past

    def separate(self, s: int, p0: int = -1, p1: int = -1) -> None:
        """Give s its own cells for whatever it shares in [p0, p1), in every cache, or raise
        NoCellsError having changed nothing."""
        self._check_separate(s, p0, p1)
        for c in self.caches:
            c.separate(s, p0, p1)

    def positions_apart(self, s: int, others: list[int]) -> np.ndarray:
        """Positions of s's cells (first cache) that none of `others` holds: the tokens that
        would leave the cache with s."""
        c = self.caches[0]
        cells = c.streams[c.stream_of(s)]
        if c.n_stream > 1:  # a stream of its own: nobody else holds its cells
            others = []
        return cells.pos[cells.held_apart(s, [o for o in others if o != s])]

    @property
    def n_shared(self) -> int:
        """Cells held by more than one sequence (the first cache: every layer's cells)."""
        return self.caches[0].n_shared

    def clear(self) -> None:
        for c in self.caches:
            c.clear()

    @property
    def used(self) -> int:
        return self.caches[0].used
