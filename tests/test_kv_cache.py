"""The KV cache of cells: n_kv padding, slot finding, the mask rules, sequence operations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ubatch.engine.batch import Batch, make_ubatch
from ubatch.engine.context.context import Context
from ubatch.engine.kv.cache import KVCache
from ubatch.engine.kv.cells import KVCells
from ubatch.engine.params import ContextParams


def cache(size: int = 1024, n_swa: int = 0, n_seq_max: int = 2, n_stream: int = 1) -> KVCache:
    return KVCache([0], size, n_stream, n_seq_max, 1, 32, 32, n_swa=n_swa)


def put(c: KVCache, seq_pos: list[tuple[list[int], int]]) -> np.ndarray:
    b = Batch()
    for sids, p in seq_pos:
        b.add(7, p, sids)
    ub = make_ubatch(b, np.arange(b.n_tokens))
    slots = c.find_slot(ub)
    assert slots is not None
    c.apply_ubatch(ub, slots)
    return slots


def query(c: KVCache, seq: int, pos: int, n_kv: int = 256) -> np.ndarray:
    b = Batch()
    b.add(7, pos, seq)
    m = c.mask(make_ubatch(b, np.arange(1)), [0], n_kv)[0, 0]
    return m == 0


@pytest.mark.parametrize(
    "used, size, n_kv", [(700, 1024, 768), (1, 1024, 256), (256, 1024, 256), (257, 1024, 512), (300, 512, 512)]
)
def test_n_kv_is_padded_to_256(used: int, size: int, n_kv: int) -> None:
    c = cache(size)
    put(c, [([0], p) for p in range(used)])
    assert c.streams[0].used_max_p1 == used and c.n_kv_of([0]) == n_kv


def test_n_kv_follows_the_last_used_cell_not_the_count() -> None:
    c = cache()
    put(c, [([0], p) for p in range(700)])
    c.seq_rm(0, 0, 100)  # holes at cells 0..99
    assert c.used == 600 and c.n_kv_of([0]) == 768
    assert c.streams[0].head == 0  # the next tokens go to the first freed cell
    assert put(c, [([0], 700)]).tolist() == [0]


def test_mask_rules() -> None:
    c = cache(n_swa=4)
    put(c, [([0], p) for p in range(6)] + [([1], p) for p in range(3)] + [([0, 1], 6)])
    vis = query(c, seq=0, pos=6)
    # cells 0..5: seq 0 positions 0..5; cells 6..8: seq 1; cell 9: position 6 shared by 0 and 1
    assert vis[:10].tolist() == [False, False, False, True, True, True, False, False, False, True]
    assert not vis[10:].any()  # empty cells
    # seq 1 at position 6 (window 4): its positions 0..2 are outside, the shared cell inside
    assert query(c, seq=1, pos=6)[:10].tolist() == [False] * 9 + [True]
    assert query(c, seq=1, pos=3)[:10].tolist() == [False] * 6 + [True] * 3 + [False]
    # a query only sees the past: position 2 of seq 0 sees cells 0..2
    assert query(c, seq=0, pos=2)[:6].tolist() == [True, True, True, False, False, False]


def test_swa_window_edge() -> None:
    c = cache(n_swa=4)
    put(c, [([0], p) for p in range(10)])
    vis = query(c, seq=0, pos=9)
    # p1 - p0 < n_swa is visible: positions 6, 7, 8, 9
    assert np.flatnonzero(vis).tolist() == [6, 7, 8, 9]
    no_swa = cache()
    put(no_swa, [([0], p) for p in range(10)])
    assert np.flatnonzero(query(no_swa, 0, 9)).tolist() == list(range(10))


def test_swa_cells_are_reused_once_outside_the_window_and_older_positions_purged() -> None:
    c = cache(size=256, n_swa=4)
    put(c, [([0], p) for p in range(256)])  # full
    slots = put(c, [([0], 256)])
    # scanning from head (wrapped to 0): cell 0 holds position 0, outside the window of 256
    assert slots.tolist() == [0]
    assert c.seq_pos_min(0) == 1 and c.seq_pos_max(0) == 256
    full = cache(size=256)
    put(full, [([0], p) for p in range(256)])
    b = Batch()
    b.add(7, 256, 0)
    assert full.find_slot(make_ubatch(b, np.arange(1))) is None  # a global cache never overwrites


def test_shared_cells_are_reused_by_the_window_only_once_every_holder_left_them() -> None:
    # llama.cpp reuses only single-sequence cells; with shared prefixes that would keep a prefix
    # longer than the window in the SWA cache for good, so a cell goes once no holder needs it
    b = Batch()
    b.add(7, 256, 0)
    c = cache(size=256, n_swa=4)
    put(c, [([0, 1], p) for p in range(256)])
    assert c.find_slot(make_ubatch(b, np.arange(1))).tolist() == [0]  # type: ignore[union-attr]
    c = cache(size=256, n_swa=4)
    put(c, [([0, 1], p) for p in range(3)] + [([0], p) for p in range(3, 256)])
    # seq 1's next token (position 3) still sees positions 0..2: the first free cell is 3
    assert c.find_slot(make_ubatch(b, np.arange(1))).tolist() == [3]  # type: ignore[union-attr]


def test_seq_cp_shares_cells_and_seq_keep_drops_the_rest() -> None:
    c = cache(n_seq_max=4)
    put(c, [([0], p) for p in range(5)])
    for s in (1, 2, 3):
        c.seq_cp(0, s)
    assert c.used == 5 and c.streams[0].seq[:5].all()
    put(c, [([1], 5)])
    c.seq_keep(1)
    assert c.used == 6 and not c.streams[0].seq[:, [0, 2, 3]].any()
    c.seq_rm(1, 3, -1)
    assert c.seq_pos_max(1) == 2


def test_seq_add_and_div_move_positions_and_record_shifts() -> None:
    c = cache()
    put(c, [([0], p) for p in range(10)])
    c.seq_add(0, 5, -1, -3)
    assert c.streams[0].pos[:10].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]
    assert c.streams[0].shift[:10].tolist() == [0] * 5 + [-3] * 5
    c.seq_add(0, 0, 3, -2)  # positions 0 and 1 would become negative: their cells are freed
    assert c.streams[0].pos[:2].tolist() == [-1, -1]
    d = cache()
    put(d, [([0], p) for p in range(8)])
    d.seq_div(0, 0, -1, 2)
    assert d.streams[0].pos[:8].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_seq_add_re_rotates_cached_k(tiny_llama_model) -> None:
    """Tokens cached at positions 10.. then shifted by -10 give the logits of a fresh run at 0.."""
    m = tiny_llama_model
    ids = [2] + list(range(30, 45))
    fresh = Context(m, ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    fresh.decode(Batch.from_tokens(ids, 0))
    fresh.decode(Batch.from_tokens([50], len(ids)))
    shifted = Context(m, ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    shifted.decode(Batch.from_tokens(ids, 10))
    shifted.memory.seq_add(0, -1, -1, -10)
    shifted.decode(Batch.from_tokens([50], len(ids)))
    torch.testing.assert_close(shifted.logits, fresh.logits, atol=1e-4, rtol=1e-4)
    assert not shifted.memory.caches[0].has_shift


@pytest.mark.parametrize("t, tol", [("f16", 0.05), ("bf16", 0.3), ("q8_0", 0.3), ("q4_0", 1.5)])
def test_quantised_caches_stay_close_to_f32(tiny_gemma_model, t: str, tol: float) -> None:
    m = tiny_gemma_model
    ids = [2] + list(range(30, 70))

    def run(kind: str) -> torch.Tensor:
        ctx = Context(m, ContextParams(n_ctx=256, type_k=kind, type_v=kind))
        ctx.decode(Batch.from_tokens(ids, 0, all_logits=True))
        return ctx.logits

    ref, got = run("f32"), run(t)
    assert 0 < (got - ref).abs().max() < tol


def fresh(c: KVCells) -> tuple[int, int, bool, list[int]]:
    """What the kept reductions must equal, computed from the arrays alone."""
    x = KVCells(c.size, c.n_seq_max)
    x.pos, x.seq, x.shift = c.pos, c.seq, c.shift
    return x.used, x.used_max_p1, x.has_shift, [x.seq_pos_max(s) for s in range(c.n_seq_max)]


@pytest.mark.parametrize("n_swa, n_stream", [(0, 1), (6, 1), (0, 3), (6, 3)])
def test_kept_cell_counts_follow_every_operation(n_swa: int, n_stream: int) -> None:
    """Decode rows, prompts and sequence operations in a seeded random order: after each, the
    reductions a step reads (kept between steps) equal a fresh pass over the arrays, and a lone
    decode row sees what the same query sees among several rows."""
    rng = np.random.default_rng(7)
    c = cache(size=64, n_swa=n_swa, n_seq_max=3, n_stream=n_stream)
    for _ in range(400):
        s = int(rng.integers(3))
        op = int(rng.integers(8))
        nxt = c.seq_pos_max(s) + 1
        if op <= 3:  # a decode row (mostly) or a short prompt
            n = 1 if op <= 2 else int(rng.integers(2, 5))
            b = Batch()
            for i in range(n):
                b.add(7, nxt + i, s)
            ub = make_ubatch(b, np.arange(n))
            cells = c.streams[c.stream_of(s)]
            head = cells.head if cells.head <= cells.used + 2 * n else 0
            scanned = c._scan(cells, n, head)  # the whole stream's scan: what find_slot must give
            slots = c.find_slot(ub)
            assert (slots is None) == (scanned is None)
            if slots is not None and scanned is not None:
                assert (slots - c.stream_of(s) * c.size).tolist() == scanned.tolist()
            if slots is None:
                c.seq_rm(s, -1, -1)
            else:
                c.apply_ubatch(ub, slots)
        elif op == 4:
            c.seq_rm(s, int(rng.integers(max(nxt, 1))), -1)
        elif op == 5 and n_stream == 1:
            c.seq_cp(s, (s + 1) % 3, -1, -1)
        elif op == 6 and n_swa == 0:
            c.seq_add(s, 0, -1, -int(rng.integers(3)))
        else:
            c.seq_keep(s) if n_stream == 1 and rng.random() < 0.2 else c.seq_div(s, 0, -1, 1)
        for cells in c.streams:
            assert (cells.used, cells.used_max_p1, cells.has_shift, [cells.seq_pos_max(q) for q in range(3)]) == fresh(
                cells
            )
        p = c.seq_pos_max(s) + 1
        one, two = Batch(), Batch()
        one.add(7, p, s)
        two.add(7, p, s)
        two.add(7, p, s)
        st = [c.stream_of(s)]
        lone = c.visible(make_ubatch(one, np.arange(1)), st, 64)[0, 0]
        among = c.visible(make_ubatch(two, np.arange(2)), st, 64)[0, 0]
        assert (lone == among).all()
