"""The server's scheduler, driven one iteration at a time on the tiny models (no HTTP).

Continuous batching: one decode per iteration carries a row from every generating slot plus
prompt chunks; results equal each request run alone. Plus the slot lifecycle: prompt cache,
context limit and shift, cancellation, KV pressure.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from ubatch.engine.context.context import Context
from ubatch.engine.errors import ErrorKind
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import SamplerParams
from ubatch.engine.serve.engine_loop import EngineLoop
from ubatch.engine.serve.scheduler import Scheduler, SlotState
from ubatch.engine.serve.task import Failed, Final, Partial, Task, TaskParams


@pytest.fixture
def gemma(tiny_gemma_model: Model) -> Model:
    return tiny_gemma_model


@pytest.fixture
def llama(tiny_llama_model: Model) -> Model:
    return tiny_llama_model


def make(model: Model, n_slots: int = 4, n_ctx: int = 1024, **kw: object) -> Scheduler:
    unified = bool(kw.pop("kv_unified", False))
    ctx = Context(
        model,
        ContextParams(
            n_ctx=n_ctx,
            n_seq_max=n_slots,
            n_outputs_max=n_slots,
            kv_unified=unified,
            n_batch=int(kw.pop("n_batch", 2048)),
        ),
    )
    return Scheduler(ctx, n_slots, **kw)  # type: ignore[arg-type]


def greedy(n: int, **kw: object) -> TaskParams:
    return TaskParams(n_predict=n, ignore_eos=True, sampling=SamplerParams(temp=0.0), **kw)  # type: ignore[arg-type]


class Collector:
    def __init__(self) -> None:
        self.events: list[object] = []

    def __call__(self, ev: object) -> None:
        self.events.append(ev)

    def final(self, task: Task) -> Final | Failed:
        return next(e for e in self.events if isinstance(e, Final | Failed) and e.task is task)


def submit(sch: Scheduler, col: Collector, prompt: list[int], params: TaskParams, i: int = 0) -> Task:
    t = Task(i, prompt, params, col, index=i)
    assert sch.accept(t)
    return t


def drain(sch: Scheduler, limit: int = 2000) -> None:
    for _ in range(limit):
        sch.step()
        if not sch.busy:
            return
    raise AssertionError("scheduler did not finish")


PROMPTS = [[2, 280, 290, 300, 45, 46], [2, 47, 48], [2, 290, 291, 292, 293, 294, 295, 296, 297, 50], [2, 60]]


def test_one_decode_carries_a_row_of_every_generating_slot(gemma: Model) -> None:
    sch, col = make(gemma), Collector()
    tasks = [submit(sch, col, p, greedy(6), i) for i, p in enumerate(PROMPTS)]
    first = sch.step()  # all four prompts, chunked into one batch
    assert first is not None and first.rows == {0: 6, 1: 3, 2: 10, 3: 2} and first.n_outputs == 4
    second = sch.step()  # then one row per sequence
    assert second is not None and second.rows == {0: 1, 1: 1, 2: 1, 3: 1} and second.n_gen == 4
    drain(sch)
    batched = [col.final(t) for t in tasks]
    assert all(isinstance(f, Final) and f.n_decoded == 6 and f.stop_type == "limit" for f in batched)
    # the same requests one at a time on a fresh scheduler give the same tokens
    for p, f in zip(PROMPTS, batched):
        solo, c2 = make(gemma), Collector()
        t = submit(solo, c2, p, greedy(6))
        drain(solo)
        assert c2.final(t).tokens == f.tokens  # type: ignore[union-attr]


def test_generation_rows_come_first_and_prompts_fill_up_to_n_batch(gemma: Model) -> None:
    sch, col = make(gemma, n_batch=16), Collector()
    submit(sch, col, PROMPTS[0], greedy(20), 0)
    sch.step()
    long_prompt = [2] + list(range(270, 300))  # 31 tokens: two chunks of at most 15 after the gen row
    submit(sch, col, long_prompt, greedy(2), 1)
    r1, r2, r3 = sch.step(), sch.step(), sch.step()
    assert (r1.rows, r2.rows, r3.rows) == ({0: 1, 1: 15}, {0: 1, 1: 15}, {0: 1, 1: 1})  # type: ignore[union-attr]
    assert sch.slots[1].state is SlotState.GENERATING


def test_without_continuous_batching_prompts_wait_for_an_empty_batch(gemma: Model) -> None:
    sch, col = make(gemma, cont_batching=False), Collector()
    submit(sch, col, PROMPTS[0], greedy(3), 0)
    sch.step()
    submit(sch, col, PROMPTS[1], greedy(3), 1)
    rows = [sch.step().rows for _ in range(3)]  # type: ignore[union-attr]
    assert rows == [{0: 1}, {0: 1}, {1: 3}]


def test_requests_beyond_the_slots_queue_and_all_complete(gemma: Model) -> None:
    sch, col = make(gemma, n_slots=2, n_ctx=512), Collector()
    tasks = [submit(sch, col, PROMPTS[i % 4], greedy(3), i) for i in range(6)]
    sch.step()
    assert sum(s.busy for s in sch.slots) == 2 and len(sch.queue) == 4
    drain(sch)
    finals = [col.final(t) for t in tasks]
    assert [f.n_decoded for f in finals] == [3] * 6  # type: ignore[union-attr]
    assert [f.tokens for f in finals[:2]] == [f.tokens for f in finals[4:]]  # type: ignore[union-attr]
    assert max(r.rows.__len__() for r in sch.records) == 2


def test_prompt_cache_reuses_the_longest_common_prefix(gemma: Model) -> None:
    sch, col = make(gemma, n_slots=1, n_ctx=256), Collector()
    t1 = submit(sch, col, PROMPTS[2], greedy(4))
    drain(sch)
    t2 = submit(sch, col, PROMPTS[2][:7] + [61, 62], greedy(4))
    drain(sch)
    t3 = submit(sch, col, PROMPTS[2], greedy(4), 2)
    drain(sch)
    f1, f2, f3 = col.final(t1), col.final(t2), col.final(t3)
    assert (f2.timings.cache_n, f2.timings.prompt_n) == (7, 2)  # type: ignore[union-attr]
    assert (f3.timings.cache_n, f3.timings.prompt_n) == (7, 3)  # type: ignore[union-attr]
    assert f3.tokens == f1.tokens  # type: ignore[union-attr]
    t4 = submit(sch, col, PROMPTS[2], greedy(4), 3)  # the same prompt again: one token evaluated
    drain(sch)
    assert (col.final(t4).timings.cache_n, col.final(t4).timings.prompt_n) == (9, 1)  # type: ignore[union-attr]


def test_context_limit_truncates_and_an_overlong_prompt_is_refused(gemma: Model) -> None:
    sch, col = make(gemma, n_slots=1, n_ctx=256), Collector()
    t = submit(sch, col, [2] + [300] * 247, greedy(-1))  # 248 tokens in a 256-token slot
    drain(sch)
    f = col.final(t)
    assert isinstance(f, Final) and (f.n_decoded, f.truncated, f.stop_type) == (8, True, "limit")
    t = submit(sch, col, [2] * 255, greedy(-1))
    drain(sch)
    assert (col.final(t).n_decoded, col.final(t).truncated) == (1, True)  # type: ignore[union-attr]
    t = submit(sch, col, [2] * 256, greedy(5))
    drain(sch)
    err = col.final(t)
    assert isinstance(err, Failed) and err.error.kind is ErrorKind.EXCEEDS_CONTEXT
    assert err.error.details == {"n_prompt_tokens": 256, "n_ctx": 256}


def test_context_shift_keeps_generating(llama: Model) -> None:
    sch, col = make(llama, n_slots=1, n_ctx=256, context_shift=True), Collector()
    assert sch.context_shift
    t = submit(sch, col, [2] + list(range(60, 300)), greedy(40))  # 241 + 40 > 256
    drain(sch)
    f = col.final(t)
    assert isinstance(f, Final) and (f.n_decoded, f.truncated, f.stop_type) == (40, True, "limit")
    assert len(sch.slots[0].cache) < 256


def test_context_shift_needs_a_shiftable_cache(gemma: Model) -> None:
    sch = make(gemma, n_slots=1, n_ctx=1024, context_shift=True)  # SWA cache: 768 cells
    assert not sch.context_shift and sch.warnings


def test_cache_reuse_shifts_matching_chunks(llama: Model) -> None:
    sch, col = make(llama, n_slots=1, n_ctx=256, cache_reuse=4), Collector()
    a, b = list(range(100, 110)), list(range(200, 220))
    submit(sch, col, [2] + a + b, greedy(1))
    drain(sch)
    t = submit(sch, col, [2] + b, greedy(3))  # b is reused from further back in the cache
    drain(sch)
    f = col.final(t)
    assert (f.timings.cache_n, f.timings.prompt_n) == (20, 1)  # type: ignore[union-attr]
    solo, c2 = make(llama, n_slots=1, n_ctx=256), Collector()
    t2 = submit(solo, c2, [2] + b, greedy(3))
    drain(solo)
    assert f.tokens == c2.final(t2).tokens  # type: ignore[union-attr]


def test_cancel_frees_the_slot_and_its_cells_within_one_iteration(gemma: Model) -> None:
    sch, col = make(gemma, n_slots=2, n_ctx=512), Collector()
    loop = EngineLoop(sch)  # its door, driven on this thread
    t = Task(0, PROMPTS[0], greedy(100), col)
    other = Task(1, PROMPTS[1], greedy(5), col, index=1)
    loop.submit(t)
    loop.submit(other)
    for _ in range(4):
        loop.iterate()
    loop.cancel(t)
    loop.iterate()
    assert not sch.slots[0].busy and sch.slots[0].cache == []
    assert sch.ctx.memory.seq_pos_max(0) == -1
    rel = next(r for r in sch.releases if r.task == t.id)
    assert rel.reason == "cancelled" and rel.iteration - rel.cancel_iteration == 1
    drain(sch)
    assert isinstance(col.final(other), Final) and not any(isinstance(e, Final) and e.task is t for e in col.events)


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.002)


def test_a_burst_at_an_idle_engine_starts_in_one_batch(gemma: Model) -> None:
    """Four requests arrive together; the first is submitted while the other three are still
    being prepared: the engine waits for them and the first decode carries all four prompts."""
    sch, col = make(gemma), Collector()
    loop = EngineLoop(sch, admit_wait_s=600.0)  # it never gives up on them here
    loop.start()
    try:
        arrivals = [loop.arrival() for _ in PROMPTS]
        for a in arrivals:
            a.__enter__()
        tasks = [Task(i, p, greedy(3), col, index=i) for i, p in enumerate(PROMPTS)]
        loop.submit(tasks[0])
        arrivals[0].__exit__(None, None, None)
        wait_until(lambda: loop.n_admit_waits == 1, "the engine waits for the others")
        assert not sch.records  # nothing decoded while they arrive
        for t, a in zip(tasks[1:], arrivals[1:], strict=True):
            loop.submit(t)
            a.__exit__(None, None, None)
        wait_until(lambda: all(any(isinstance(e, Final) and e.task is t for e in col.events) for t in tasks), "finals")
    finally:
        loop.stop()
    first = sch.records[0]
    assert first.rows == {i: len(p) for i, p in enumerate(PROMPTS)} and first.n_gen == 0
    assert loop.n_arriving == 0


def test_arrivals_never_delay_a_running_stream(gemma: Model) -> None:
    """With a slot generating, a new prompt runs at once beside it, whatever is still arriving
    (decode rows first, prompt chunks fill the rest: llama-server's policy)."""
    sch, col = make(gemma), Collector()
    loop = EngineLoop(sch, admit_wait_s=600.0)
    loop.start()
    try:
        running = Task(0, PROMPTS[0], greedy(200), col)
        loop.submit(running)
        wait_until(lambda: sch.slots[0].state is SlotState.GENERATING, "the first stream generates")
        late = Task(1, PROMPTS[1], greedy(2), col, index=1)
        with loop.arrival():  # another request is still being prepared
            loop.submit(late)
            wait_until(lambda: any(isinstance(e, Final) and e.task is late for e in col.events), "the late one ends")
        assert loop.n_admit_waits == 0
        rec = next(r for r in sch.records if 1 in r.rows)
        assert rec.rows == {0: 1, 1: len(PROMPTS[1])}  # its prompt joined a decode step
    finally:
        loop.stop()


def test_an_idle_engine_waits_for_arrivals_only_so_long(gemma: Model) -> None:
    """A request whose preparation takes long (a hostile grammar) holds the others back at most
    `admit_wait_s`."""
    sch, col = make(gemma), Collector()
    loop = EngineLoop(sch, admit_wait_s=0.01)
    loop.start()
    try:
        with loop.arrival():  # never submits while the other runs
            t = Task(0, PROMPTS[0], greedy(2), col)
            loop.submit(t)
            wait_until(lambda: any(isinstance(e, Final) and e.task is t for e in col.events), "it runs anyway")
        assert loop.n_admit_waits == 1
    finally:
        loop.stop()


def test_stop_string_cuts_the_text_and_withholds_partial_matches(gemma: Model) -> None:
    sch, col = make(gemma, n_slots=1, n_ctx=256), Collector()
    t = submit(sch, col, PROMPTS[0], greedy(12))
    drain(sch)
    text = col.final(t).content  # type: ignore[union-attr]
    word = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(word) == 3
    t = submit(sch, col, PROMPTS[0], greedy(12, stop=[word], stream=True), 1)
    drain(sch)
    f = col.final(t)
    streamed = "".join(e.text for e in col.events if isinstance(e, Partial) and e.task is t)
    assert isinstance(f, Final) and (f.stop_type, f.stopping_word) == ("word", word)
    assert streamed + f.content == text[: text.find(word)]


def test_n_predict_zero_still_returns_one_token_and_empty_prompt_answers_at_once(gemma: Model) -> None:
    sch, col = make(gemma, n_slots=1, n_ctx=256), Collector()
    t = submit(sch, col, PROMPTS[1], greedy(0))
    e = submit(sch, col, [], greedy(5), 1)
    drain(sch)
    assert col.final(t).n_decoded == 1  # type: ignore[union-attr]
    assert (col.final(e).n_decoded, col.final(e).content) == (0, "")  # type: ignore[union-attr]


def test_unified_kv_purges_idle_caches_when_full(gemma: Model) -> None:
    sch, col = make(gemma, n_slots=2, n_ctx=256, kv_unified=True), Collector()
    assert sch.n_ctx_slot == 256
    t = submit(sch, col, [2] + [300] * 199, greedy(1))
    drain(sch)
    assert len(sch.slots[0].cache) == 200
    t = submit(sch, col, [2] + [301] * 199, greedy(3), 1)  # does not fit next to slot 0's cache
    drain(sch)
    f = col.final(t)
    assert isinstance(f, Final) and f.n_decoded == 3 and sch.slots[0].cache == []


def test_no_cells_postpones_prompt_rows_then_the_slot_holding_most_cells_gives_way(gemma: Model) -> None:
    sch, col = make(gemma, n_slots=2, n_ctx=256, kv_unified=True), Collector()
    a = submit(sch, col, [2] + [300] * 179, greedy(60))
    for _ in range(3):
        sch.step()
    b = submit(sch, col, [2] + [301] * 99, greedy(60), 1)  # 100 prompt rows next to 182 cells: 74 free
    drain(sch)
    halved = [r for r in sch.records if r.retries and r.n_prompt]
    assert halved and halved[0].n_gen == 1 and halved[0].n_prompt <= 74
    fa, fb = col.final(a), col.final(b)
    assert isinstance(fa, Failed) and fa.error.message == "Context size has been exceeded."  # it held the most cells
    assert isinstance(fb, Final) and fb.n_decoded == 60
    assert [r.reason for r in sch.releases] == ["error", "limit"]
