"""Why each cell of a ubatch's KQ mask is hidden: the reasons behind `KVCache.mask`.

The mask itself only says visible or not (0 or -inf). `explain` draws the grid with a reason
for every hidden cell, read from the same cell arrays and the same window rule the mask uses;
tests/test_explain.py checks that "visible" here is exactly the engine's mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ubatch.engine.batch import UBatch
from ubatch.engine.kv.cache import KVCache

VISIBLE, EMPTY, OTHER_SEQ, FUTURE, WINDOW = range(5)
MAX_GRID_CELLS = 256
REASONS = ("visible", "empty", "other sequence", "future", "outside the window")


def classify(cache: KVCache, ub: UBatch, streams: list[int], n_kv: int, causal: bool = True) -> np.ndarray:
    """int8 [n_groups, n_tokens / n_groups, n_kv]: VISIBLE, or the first reason a cell is hidden
    (in this order: empty, another sequence, the query's future, outside its window)."""
    per = ub.n_tokens // len(streams)
    out = np.empty((len(streams), per, n_kv), dtype=np.int8)
    for g, s in enumerate(streams):
        c, rows = cache.streams[s], slice(g * per, (g + 1) * per)
        pos, p1 = c.pos[:n_kv][None, :], ub.pos[rows, None]
        empty = np.broadcast_to(pos < 0, (per, n_kv))
        other = ~c.seq[:n_kv][:, ub.seq_id0[rows]].T
        future = (pos > p1) if causal else np.zeros((per, n_kv), dtype=bool)
        window = cache.masked_swa(pos, p1)
        code = np.full((per, n_kv), VISIBLE, dtype=np.int8)
        for reason, hit in ((WINDOW, window), (FUTURE, future), (OTHER_SEQ, other), (EMPTY, empty)):
            code[hit] = reason  # later rules win: empty is the first reason given
        out[g] = code
    return out


@dataclass(slots=True)
class MaskGrid:
    """One cache's mask for one ubatch, as reasons: rows are the ubatch's queries (in ubatch
    order), columns the cells [first_cell, n_cells) of each group's stream; cells from n_cells
    to n_kv are empty (the padding of n_kv to its 256 quantum)."""

    cache: str
    n_kv: int
    n_cells: int  # one past the last used cell
    first_cell: int  # the grid's first cell (only the last MAX_GRID_CELLS used cells are kept)
    streams: list[int]
    row_seq: list[int]  # the sequence id each query row attends as
    row_pos: list[int]
    row_kind: str  # per row, its RowKind's letter (engine/batch.py)
    cell_pos: list[list[int]]  # per group: the position held by each shown cell (-1: empty)
    codes: list[list[list[int]]]  # [group][row of the group][cell]


def mask_grid(cache: KVCache, ub: UBatch, kinds: str, n_kv: int, causal: bool = True) -> MaskGrid:
    """The reasons grid of one ubatch for one cache, cut to the last MAX_GRID_CELLS cells in use
    (what is past them is empty by definition of used_max_p1)."""
    streams = cache.ubatch_streams(ub)
    n_cells = max(cache.streams[s].used_max_p1 for s in streams)
    first = max(0, n_cells - MAX_GRID_CELLS)
    codes = classify(cache, ub, streams, n_kv, causal)[:, :, first:n_cells]
    return MaskGrid(
        cache.name or "KV",
        n_kv,
        n_cells,
        first,
        streams,
        [int(s) for s in ub.seq_id0],
        [int(p) for p in ub.pos],
        kinds,
        [cache.streams[s].pos[first:n_cells].tolist() for s in streams],
        codes.tolist(),
    )
