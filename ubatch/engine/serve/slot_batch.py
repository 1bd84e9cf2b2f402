"""Which rows go into one scheduler iteration's batch: llama-server's order, generation rows first
(one per generating slot: its last sampled token), then prompt chunks of the slots still
processing their prompt, in slot order, until n_batch rows; and what gives way when the KV cache
has no cells for them. Kept apart from the loop, and free of the context, because these are the
rules that decide how full each decode call is (tests/test_slot_batch.py runs them on fake slots).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ubatch.engine.batch import Batch, RowKind
from ubatch.engine.errors import EngineError
from ubatch.engine.serve.slot import Slot, SlotState
from ubatch.engine.serve.stats import IterationRecord


class SlotRows(NamedTuple):
    """A slot's share of the batch: its rows and the batch index of its output row (-1: none)."""

    slot: Slot
    n: int
    out: int


@dataclass(slots=True)
class Plan:
    """One iteration as the scheduler decided it (engine/serve/scheduler.py `schedule`). The
    runner (engine/serve/runner.py) rebuilds `batch` and `parts` in place when the KV cache has
    no cells for them, and lists the slots it gave up to make room; the post-process reads the
    plan as it was decoded."""

    iteration: int
    slots: Sequence[Slot]  # every slot, in order: a rebuilt batch may take rows of one not in it yet
    batch: Batch
    parts: list[SlotRows]
    budget: int  # prompt rows allowed: n_batch, halved while the cells run out
    cont_batching: bool = True
    retries: int = 0  # decode calls refused before this one
    given_up: list[tuple[Slot, EngineError]] = field(default_factory=list)

    def reassemble(self) -> None:
        """The batch again from the slots' state, within `budget`, without the slots given up."""
        skip = {s.id for s, _ in self.given_up}
        self.batch, self.parts = assemble([s for s in self.slots if s.id not in skip], self.budget, self.cont_batching)


def assemble(slots: Sequence[Slot], budget: int, cont_batching: bool = True) -> tuple[Batch, list[SlotRows]]:
    """The batch for this iteration and each slot's share; `budget` caps the prompt rows.
    A generating slot contributes its sampled token and then its draft (engine/serve/slot_spec.py)."""
    b, parts = Batch(), []
    for s in slots:
        if s.state is SlotState.GENERATING and s.gen is not None:
            parts.append(SlotRows(s, 1 + len(s.draft.tokens), b.n_tokens))
            b.add(s.gen.sampled, len(s.cache), s.id, True, RowKind.GENERATED)
            for i, t in enumerate(s.draft.tokens):  # speculative: each drafted token, an output each
                b.add(t, len(s.cache) + 1 + i, s.id, True, RowKind.DRAFTED)
    if not cont_batching and b.n_tokens:
        return b, parts
    for s in slots:
        if s.state is not SlotState.PROCESSING_PROMPT or s.task is None or b.n_tokens >= budget:
            continue
        prompt = s.task.prompt
        n = min(len(prompt) - s.i_prompt, budget - b.n_tokens)
        last = s.i_prompt + n == len(prompt)
        pos0 = len(s.cache)
        for j in range(n):
            b.add(prompt[s.i_prompt + j], pos0 + j, s.id, last and j == n - 1)
        parts.append(SlotRows(s, n, b.n_tokens - 1 if last else -1))
    return b, parts


def halved_budget(parts: Collection[SlotRows], n_tokens: int) -> int | None:
    """No cells for this batch (its drafts already dropped): the budget that postpones half of
    its prompt rows, as llama-server does, or None when no prompt row can wait."""
    n_gen = sum(1 for s, _, _ in parts if s.state is SlotState.GENERATING)
    n_prompt = n_tokens - n_gen
    if n_prompt > 1 or (n_prompt == 1 and n_gen > 0):
        return n_gen + n_prompt // 2
    return None


def victim(parts: Collection[SlotRows]) -> Slot:
    """Nothing left to postpone: the slot holding the most cells gives way."""
    return max((s for s, _, _ in parts), key=lambda s: len(s.cache))


def record_of(
    parts: list[SlotRows], iteration: int, batch: Batch, n_ubatch: int, ms: float, retries: int, n_queued: int
) -> IterationRecord:
    """What the decode call carried, per sequence and by kind of row, for /iterations and /metrics."""
    rows: dict[int, int] = {}
    for s, n, _ in parts:
        rows[s.id] = rows.get(s.id, 0) + n
    n_gen = sum(n for s, n, _ in parts if s.state is SlotState.GENERATING)
    return IterationRecord(
        iteration,
        batch.n_tokens,
        sum(batch.logits),
        rows,
        n_gen,
        batch.n_tokens - n_gen,
        n_ubatch,
        ms,
        retries,
        n_queued,
    )
