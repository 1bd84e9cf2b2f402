"""The scheduler's policy on fake slots, without a model: which rows one iteration's batch takes
(engine/serve/slot_batch.py) and what gives way when the KV cache has no cells for them."""

from __future__ import annotations

from types import SimpleNamespace

from ubatch.engine.errors import EngineError, ErrorKind
from ubatch.engine.serve.slot import Slot, SlotState, SlotTokens
from ubatch.engine.serve.slot_batch import Plan, assemble, halved_budget, victim
from ubatch.engine.serve.task import Task, TaskParams
from ubatch.engine.spec.speculative import Draft


def generating(i: int, n_cached: int, sampled: int, draft: list[int] = ()) -> Slot:  # type: ignore[assignment]
    s = Slot(i, 1024, SlotState.GENERATING, cache=SlotTokens(range(n_cached)))
    s.gen = SimpleNamespace(sampled=sampled)  # type: ignore[assignment]  # assemble reads only the sampled token
    s.draft = Draft(list(draft))
    return s


def prefilling(i: int, prompt: list[int], done: int = 0) -> Slot:
    s = Slot(i, 1024, SlotState.PROCESSING_PROMPT, cache=SlotTokens(prompt[:done]), i_prompt=done)
    s.task = Task(i, prompt, TaskParams(), lambda e: None)
    return s


def test_generation_rows_and_their_drafts_come_first_then_prompt_chunks_within_the_budget() -> None:
    slots = [prefilling(0, list(range(100, 110))), generating(1, 5, 7, [8, 9]), prefilling(2, [1, 2, 3])]
    b, parts = assemble(slots, budget=8)
    assert b.token == [7, 8, 9, 100, 101, 102, 103, 104]  # slot 2 waits: the budget is spent
    assert b.pos == [5, 6, 7, 0, 1, 2, 3, 4] and b.kind == ["g", "d", "d"] + ["p"] * 5
    assert b.logits == [True, True, True] + [False] * 5  # slot 0's chunk is not its prompt's end
    assert [(p.slot.id, p.n, p.out) for p in parts] == [(1, 3, 0), (0, 5, -1)]


def test_a_prompt_chunk_that_ends_the_prompt_has_its_output_row() -> None:
    b, parts = assemble([prefilling(0, [1, 2, 3, 4], done=2), generating(1, 3, 5)], budget=16)
    assert b.token == [5, 3, 4] and b.pos == [3, 2, 3] and b.logits == [True, False, True]
    assert [(p.slot.id, p.n, p.out) for p in parts] == [(1, 1, 0), (0, 2, 2)]


def test_without_continuous_batching_prompts_wait_while_a_slot_generates() -> None:
    slots = [prefilling(0, [1, 2]), generating(1, 3, 5)]
    assert assemble(slots, 16, cont_batching=False)[0].token == [5]
    assert assemble([prefilling(0, [1, 2])], 16, cont_batching=False)[0].token == [1, 2]


def test_no_cells_halves_the_prompt_rows_then_gives_up_the_slot_holding_most_cells() -> None:
    gen, pre = generating(0, 40, 5), prefilling(1, list(range(30)))
    b, parts = assemble([gen, pre], 64)
    assert halved_budget(parts, b.n_tokens) == 1 + 15
    b, parts = assemble([pre], 64)
    assert halved_budget(parts, b.n_tokens) == 15
    lone = prefilling(2, [1])
    b, parts = assemble([gen, lone], 64)
    assert halved_budget(parts, b.n_tokens) == 1 + 0  # a lone prompt row waits for the generating one
    b, parts = assemble([lone], 64)
    assert halved_budget(parts, b.n_tokens) is None and victim(parts) is lone
    b, parts = assemble([generating(3, 10, 1), gen, generating(4, 20, 2)], 64)
    assert halved_budget(parts, b.n_tokens) is None and victim(parts) is gen


def test_a_rebuilt_plan_leaves_out_the_slots_given_up_and_takes_the_rows_they_left() -> None:
    slots = [generating(0, 40, 5), prefilling(1, list(range(10))), prefilling(2, [7, 8, 9])]
    b, parts = assemble(slots, 11)
    plan = Plan(1, slots, b, parts, 11)
    assert [p.slot.id for p in plan.parts] == [0, 1]
    plan.given_up.append((slots[0], EngineError(ErrorKind.INTERNAL, "no cells")))
    plan.reassemble()
    assert [(p.slot.id, p.n) for p in plan.parts] == [(1, 10), (2, 1)] and plan.batch.n_tokens == 11
