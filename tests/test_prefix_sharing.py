"""Shared prefixes (engine/serve/prefix_index.py): a prompt reuses a prefix held by any sequence
(cells shared with -kvu, rows copied between per-slot streams) or by host memory (--cache-ram),
and the answers stay those of each request run alone.

The randomised test drives the scheduler with rounds of requests that share system prompts (or
part of one), diverge, follow up on earlier answers, repeat, overflow the context (shift), get
cancelled, ask for a given slot and land on reused slots, so that a slot often holds part of a
prefix another sequence holds more of (it keeps its own cells and takes the rest), and checks after every iteration that each slot's tokens are exactly its
cells, that shared cells hold the same token for every holder and that no cell is held by
nobody; every answer is compared with the same request run alone on a fresh cache.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import SamplerParams
from ubatch.engine.serve.scheduler import Scheduler, Slot
from ubatch.engine.serve.task import Failed, Final, Task, TaskParams


@pytest.fixture(scope="module")
def tiny_short_llama_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """Trained for 192 positions: a unified cache of 512 cells then holds a slot's whole context
    next to others, so a context shift moves cells other sequences share."""
    from tiny_models import TinySpec, write_tiny_model

    return Model.load(
        write_tiny_model(tmp_path_factory.mktemp("m") / "short.gguf", TinySpec(arch="llama", n_ctx_train=192))
    )


def make(model: Model, n_slots: int, n_ctx: int, unified: bool, **kw: object) -> Scheduler:
    cp = ContextParams(n_ctx=n_ctx, n_seq_max=n_slots, n_outputs_max=n_slots, kv_unified=unified, n_batch=64)
    return Scheduler(Context(model, cp), n_slots, **kw)  # type: ignore[arg-type]


def greedy(n: int, cache_prompt: bool = True) -> TaskParams:
    return TaskParams(n_predict=n, ignore_eos=True, cache_prompt=cache_prompt, sampling=SamplerParams(temp=0.0))


class Sink:
    def __init__(self) -> None:
        self.events: list[object] = []

    def __call__(self, ev: object) -> None:
        self.events.append(ev)

    def result(self, t: Task) -> Final | Failed | None:
        return next((e for e in self.events if isinstance(e, Final | Failed) and e.task is t), None)


def run(sch: Scheduler, tasks: list[Task], cancel: dict[int, int] | None = None, check: bool = True) -> None:
    for t in tasks:
        assert sch.accept(t)
    for i in range(5000):
        for t in tasks:
            if cancel and cancel.get(t.id) == i:
                t.cancelled = True
        sch.step()
        if check:
            check_cells(sch)
        if not sch.busy:
            return
    raise AssertionError("the scheduler did not finish")


def check_cells(sch: Scheduler) -> None:
    """Every cell accounted for: held iff used, held only by slots' sequences, each slot's cells
    exactly its tokens' positions (once each), a shared cell the same token for every holder."""
    mem, n = sch.ctx.memory, len(sch.slots)
    for c in mem.caches:
        for cells in c.streams:
            assert ((cells.pos >= 0) == cells.seq.any(1)).all(), "a cell used by nobody, or held while empty"
            assert not cells.seq[:, n:].any()
    c0 = mem.caches[0]
    for s in sch.slots:
        cells = c0.streams[c0.stream_of(s.id)]
        pos = np.sort(cells.pos[cells.seq[:, s.id]])
        assert pos.tolist() == list(range(len(s.cache))), (
            f"slot {s.id}: cells {pos.tolist()[:8]}.. vs {len(s.cache)} tokens"
        )
        for c in mem.caches[1:]:  # the sliding-window cache: a tail of the same positions
            w = c.streams[c.stream_of(s.id)]
            wp = np.sort(w.pos[w.seq[:, s.id]])
            assert wp.size == 0 or wp.tolist() == list(range(int(wp[0]), len(s.cache)))
    for cells in c0.streams:
        for cell in np.flatnonzero(cells.seq.sum(1) > 1).tolist():
            p = int(cells.pos[cell])
            holders = np.flatnonzero(cells.seq[cell]).tolist()
            assert len({sch.slots[h].cache[p] for h in holders}) == 1, "a shared cell holds different tokens"
            assert all(p < sch.slots[h].n_exact for h in holders), "an inexact cell was shared"


class Solo:
    """Each request alone on a fresh cache of the same per-slot size: the reference answers."""

    def __init__(self, model: Model, n_ctx: int, context_shift: bool) -> None:
        self.sch = make(model, 1, n_ctx, False, context_shift=context_shift, prefix_sharing=False, cache_ram_mib=0)
        self.memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def tokens(self, prompt: list[int], n_predict: int) -> list[int]:
        key = (tuple(prompt), n_predict)
        if key not in self.memo:
            sink = Sink()
            t = Task(0, prompt, greedy(n_predict, cache_prompt=False), sink)
            run(self.sch, [t], check=False)
            f = sink.result(t)
            assert isinstance(f, Final)
            self.memo[key] = list(f.tokens)
        return self.memo[key]


ROUNDS, MAX_ROUNDS = 16, 48  # more rounds (up to MAX_ROUNDS) until every case below happened
CONFIGS = [  # model, slots, n_ctx, unified, context shift
    pytest.param("llama", 3, 256, True, True, id="llama-kvu"),
    pytest.param("short_llama", 3, 512, True, True, id="llama-kvu-shift"),
    pytest.param("llama", 2, 512, False, True, id="llama-streams"),
    pytest.param("gemma", 3, 512, True, False, id="gemma-swa-kvu"),
]


@pytest.mark.parametrize(("arch", "n_slots", "n_ctx", "unified", "shift"), CONFIGS)
def test_random_rounds_answer_as_solo_runs_and_account_for_every_cell(
    arch: str, n_slots: int, n_ctx: int, unified: bool, shift: bool, request: pytest.FixtureRequest
) -> None:
    model: Model = request.getfixturevalue(f"tiny_{arch}_model")
    rng = np.random.default_rng(36 + n_slots + n_ctx)
    sch = make(model, n_slots, n_ctx, unified, context_shift=shift, cache_ram_mib=1)
    sch.prefixes.min_shared = 1  # share even one token: the most sharing to get wrong
    solo = Solo(model, sch.n_ctx_slot, shift)
    systems = [[2, *rng.integers(10, 250, int(rng.integers(16, 72))).tolist()] for _ in range(3)]
    systems.append([2, *rng.integers(10, 250, sch.n_ctx_slot * 6 // 10).tolist()])  # a shift moves its cells
    done: list[list[int]] = []  # prompt + answer of every finished request: follow-ups extend them
    shifts, partial, compared, next_id = 0, 0, 0, 0

    def released(kind: str, s: Slot) -> None:
        nonlocal shifts, partial
        if kind == "release" and s.gen is not None:
            shifts += s.gen.n_shifts
        if kind == "launch" and s.reuse.n_own and s.reuse.n_shared:  # kept its own, took the rest
            partial += 1

    sch.listener = released
    n_failed = 0

    def covered() -> bool:
        """Sharing (a partial take among them), RAM restores and shifts all happened."""
        st = sch.stats
        return st.n_hits_shared > 0 and partial > 0 and st.n_hits_ram > 0 and (shifts > 0 or not shift)

    rounds = 0
    while rounds < MAX_ROUNDS and (rounds < ROUNDS or not covered()):
        rounds += 1
        tasks, want, cancel = [], {}, {}
        for _ in range(int(rng.integers(1, n_slots + 3))):
            kind = rng.random()
            if kind < 0.5:
                system = systems[int(rng.integers(len(systems)))]
                if rng.random() < 0.25:  # part of a system prompt: a later full one keeps it, takes the rest
                    system = system[: int(rng.integers(2, len(system)))]
                prompt = system + rng.integers(10, 250, int(rng.integers(0, 12))).tolist()
            elif kind < 0.75 and done:
                prompt = done[int(rng.integers(len(done)))] + rng.integers(10, 250, int(rng.integers(1, 8))).tolist()
            elif kind < 0.85 and done:
                prompt = list(done[int(rng.integers(len(done)))])
            else:
                prompt = [2, *rng.integers(10, 250, int(rng.integers(4, 40))).tolist()]
            prompt = prompt[: sch.n_ctx_slot * 7 // 10]
            n_predict = int(rng.integers(1, 12))
            if shift and rng.random() < 0.12:
                n_predict = sch.n_ctx_slot  # runs past the context: shifts
            t = Task(next_id, prompt, greedy(n_predict), Sink())
            if rng.random() < 0.3:  # on a given slot: its own prefix may be shorter than another's
                t.params.id_slot = int(rng.integers(n_slots))
            next_id += 1
            if rng.random() < 0.12:
                cancel[t.id] = int(rng.integers(0, 6))
            tasks.append(t)
            want[t.id] = n_predict
        run(sch, tasks, cancel)
        for t in tasks:
            assert isinstance(t.sink, Sink)
            r = t.sink.result(t)
            n_failed += isinstance(r, Failed)
            if t.cancelled or isinstance(r, Failed) or r is None:
                continue
            assert list(r.tokens) == solo.tokens(t.prompt, want[t.id]), f"task {t.id} differs from its solo run"
            compared += 1
            if len(t.prompt) + len(r.tokens) < sch.n_ctx_slot // 2:
                done.append(t.prompt + list(r.tokens[:-1]))
    st = sch.stats
    print(  # shown with -s: what the rounds exercised
        f"{arch} unified={unified}: rounds {rounds}, compared {compared}, failed {n_failed}, cancelled {st.n_cancelled}, "
        f"hits own/shared/ram {st.n_hits_own}/{st.n_hits_shared}/{st.n_hits_ram}, tokens "
        f"{st.n_reused_own_total}/{st.n_reused_shared_total}/{st.n_reused_ram_total}, saved {sch.host.n_saved}, "
        f"evictions {st.n_evictions}, waits {st.n_waited_prefix}, shifts {shifts}, partial takes {partial}"
    )
    assert compared >= 30
    assert st.n_hits_shared > 0 and st.n_reused_shared_total > 0 and partial > 0
    assert st.n_hits_ram > 0 and sch.host.n_saved > 0
    if shift:
        assert shifts > 0


def test_shared_prefix_is_computed_once_and_held_once(tiny_llama_model: Model) -> None:
    """Four requests with one 100-token system prompt on -np 4 -kvu: the prompt is prefilled
    once, its cells are held once by all four sequences; the answers are the solo ones."""
    sch = make(tiny_llama_model, 4, 1024, True)
    system = [2, *range(100, 199)]
    tasks = [Task(i, system + [20 + i, 30 + i], greedy(4), Sink()) for i in range(4)]
    run(sch, tasks)
    computed = sum(r.n_prompt for r in sch.records)
    assert computed == 102 + 3 * 2  # the first prompt whole, then each question only
    assert sch.stats.n_reused_shared_total == 3 * 100 and sch.stats.n_hits_shared == 3
    assert sch.ctx.memory.used == 100 + 4 * (2 + 3)  # the prefix once, each question and answer
    assert sch.n_cells_shared == 100
    solo = Solo(tiny_llama_model, sch.n_ctx_slot, False)
    for t in tasks:
        r = t.sink.result(t)  # type: ignore[attr-defined]
        assert isinstance(r, Final) and list(r.tokens) == solo.tokens(t.prompt, 4)
        assert r.timings.cache_n == (0 if t.id == 0 else 100)


def test_separation_keeps_the_other_sequence_view(tiny_llama_model: Model) -> None:
    """A shift of one holder of shared cells moves only its own copy (rows copied on the device)."""
    ctx = Context(tiny_llama_model, ContextParams(n_ctx=256, n_seq_max=2, kv_unified=True))
    mem = ctx.memory
    from ubatch.engine.batch import Batch

    b = Batch()
    for p in range(10):
        b.add(100 + p, p, 0, p == 9)
    ctx.decode(b)
    mem.seq_cp(0, 1, 0, 10)
    assert mem.n_shared == 10 and mem.used == 10
    k = mem.caches[0].k[0].data[:10].clone()
    mem.seq_rm(1, 2, 4)
    mem.seq_add(1, 4, 10, -2)
    assert mem.seq_pos_max(0) == 9 and mem.seq_pos_max(1) == 7
    assert mem.n_shared == 2 and mem.used == 16  # 0..1 still shared; 4..9 separated for seq 1
    assert mem.caches[0].streams[0].pos[:10].tolist() == list(range(10))  # seq 0's cells untouched
    assert bool((mem.caches[0].k[0].data[:10] == k).all())


def test_a_prefix_that_leaves_the_cache_is_restored_from_host_memory(tiny_llama_model: Model) -> None:
    """--cache-ram: slot reuse saves the prompt it drops; a later request restores it instead
    of prefilling, with the answer of a solo run; -cram 0 keeps nothing."""
    a, b = [2, *range(100, 160)], [2, *range(170, 230)]
    for mib, n_ram in ((1, len(a) - 1), (0, 0)):  # the BOS is the slot's own in both
        sch = make(tiny_llama_model, 1, 256, False, cache_ram_mib=mib)
        tasks = [Task(i, p, greedy(3), Sink()) for i, p in enumerate((a, b, a + [5]))]
        for t in tasks:
            run(sch, [t])
        assert sch.slots[0].reuse.n_ram == n_ram and sch.stats.n_hits_ram == (1 if mib else 0)
        assert sch.host.n_saved == (2 if mib else 0)  # a, then b when the third request took the slot
        r = tasks[2].sink.result(tasks[2])  # type: ignore[attr-defined]
        assert isinstance(r, Final) and r.timings.prompt_n == len(a) - n_ram
        assert list(r.tokens) == Solo(tiny_llama_model, 256, False).tokens(a + [5], 3)


def test_eviction_takes_idle_cells_nobody_else_holds_first(tiny_llama_model: Model) -> None:
    """Under KV pressure: the least recently used idle sequence's own cells go first (saved to
    host memory), shared prefixes last, and nothing else is touched."""
    sch = make(tiny_llama_model, 3, 512, True)
    s = [2, *range(100, 139)]  # 40 tokens both prompts share
    run(sch, [Task(0, s + list(range(150, 170)), greedy(2), Sink())])
    on_1 = TaskParams(n_predict=2, ignore_eos=True, id_slot=1, sampling=SamplerParams(temp=0.0))
    run(sch, [Task(1, s + list(range(180, 200)), on_1, Sink())])  # slot 0 would keep its own prefix
    x, y = sorted((sl for sl in sch.slots if sl.cache), key=lambda sl: sl.t_last_used)
    assert y.reuse.n_shared == 40 and sch.n_cells_shared == 40
    ev = sch.prefixes.evict_idle
    assert ev() and x.cache == s and len(y.cache) == 61 and sch.host.n_saved == 1  # x's own tail
    assert ev() and y.cache == s and sch.ctx.memory.used == 40  # y's own tail; the prefix stays
    assert ev() and x.cache == [] and y.cache == s  # a holder of the shared prefix lets go
    assert ev() and y.cache == [] and sch.ctx.memory.used == 0
    assert not ev()
    check_cells(sch)


@pytest.mark.parametrize(
    ("arch", "unified", "n_prefix"),
    [("llama", True, 100), ("llama", False, 100), ("gemma", True, 300), ("gemma", False, 300)],
    ids=["llama-kvu", "llama-streams", "gemma-swa-kvu", "gemma-swa-streams"],
)
def test_a_slot_keeps_its_own_prefix_and_takes_only_what_it_lacks(
    arch: str, unified: bool, n_prefix: int, request: pytest.FixtureRequest
) -> None:
    """Slot 1 computed the first 40 tokens of a prefix on its own; slot 0 holds all of it. A
    request on slot 1 keeps its 40 cells (the same cells: nothing freed and taken again) and
    takes only the rest from slot 0. With gemma's window of 8 the prefix is long enough that
    slot 0's window cells start past 40: the window cache takes those, and every sequence's
    window cells stay one run (check_cells). The answer is the solo one."""
    model: Model = request.getfixturevalue(f"tiny_{arch}_model")
    sch = make(model, 2, 1024, unified)
    mem = sch.ctx.memory
    p = [2, *(100 + i % 150 for i in range(n_prefix - 1))]
    on_1 = TaskParams(n_predict=3, ignore_eos=True, id_slot=1, cache_prompt=False, sampling=SamplerParams(temp=0.0))
    run(sch, [Task(0, p + [20], replace(on_1, id_slot=0, cache_prompt=True), Sink())])
    run(sch, [Task(1, p[:40] + [30], on_1, Sink())])  # no cache: slot 1 computes its 41 tokens itself
    c0 = mem.caches[0]
    full = c0.streams[c0.stream_of(1)]
    own_cells = np.flatnonzero(full.seq[:, 1] & (full.pos < 40))
    assert sch.n_cells_shared == 0 and own_cells.size == 40
    if arch == "gemma":
        assert mem.caches[1].seq_pos_min(0) > 40  # slot 0's window cells start past slot 1's prefix
    on_1.cache_prompt = True
    t = Task(2, p + [40], on_1, Sink())
    run(sch, [t])
    s1 = sch.slots[1]
    assert (s1.reuse.n_own, s1.reuse.n_shared, s1.reuse.n_ram, s1.reuse.source) == (40, n_prefix - 40, 0, 0)
    assert (full.pos[own_cells] == np.arange(40)).all() and full.seq[own_cells, 1].all()  # the same cells
    if unified:
        assert not full.seq[own_cells, 0].any()  # still its own, next to slot 0's copy
        assert sch.n_cells_shared >= n_prefix - 40 - (8 + 64 if arch == "gemma" else 0)
    r = t.sink.result(t)  # type: ignore[attr-defined]
    assert isinstance(r, Final) and list(r.tokens) == Solo(model, sch.n_ctx_slot, False).tokens(t.prompt, 3)


def test_an_embedding_that_borrows_a_slot_saves_its_prompt_to_host_memory(tiny_llama_model: Model) -> None:
    """A server with embeddings on also answers completions on the same slots: the embedding
    runner borrowing the only slot sends the completion prompt it held to host memory, and the
    next completion with that prefix restores it (with the solo answer). The embedding prompt
    itself is not kept (it is stateless, as in llama-server)."""
    from ubatch.engine.serve.embedding_task import EmbdTask, EmbeddingRunner

    ctx = Context(tiny_llama_model, ContextParams(n_ctx=256, n_seq_max=1, n_batch=64), embeddings=True, pooling="mean")
    sch = Scheduler(ctx, 1, cache_ram_mib=1)
    a = [2, *range(100, 160)]
    run(sch, [Task(0, a, greedy(3), Sink())])
    held = list(sch.slots[0].cache)
    assert sch.host.n_saved == 0
    emb = EmbeddingRunner(ctx, sch.slots, sch.stats)
    sink = Sink()
    emb.accept(EmbdTask(1, [2, *range(30, 50)], sink))
    emb.step()
    assert any(getattr(e, "embedding", None) for e in sink.events)
    assert sch.slots[0].cache == [] and ctx.memory.used == 0
    assert sch.host.n_saved == 1 and sch.host.holds(held)
    t = Task(2, a + [7], greedy(3), Sink())
    run(sch, [t])
    assert sch.slots[0].reuse.n_ram == len(a) and sch.host.n_saved == 1
    r = t.sink.result(t)  # type: ignore[attr-defined]
    assert isinstance(r, Final) and list(r.tokens) == Solo(tiny_llama_model, 256, False).tokens(a + [7], 3)
