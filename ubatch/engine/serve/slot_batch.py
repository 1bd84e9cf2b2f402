"""Which rows go into one scheduler iteration's batch: llama-server's order, generation rows first
(one per generating slot: its last sampled token), then prompt chunks of the slots still
processing their prompt, in slot order, until n_batch rows. Kept apart from the loop because it
is the rule that decides how full each decode call is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ubatch.engine.batch import Batch
from ubatch.engine.serve.slot import Slot, SlotState
from ubatch.engine.serve.stats import IterationRecord


class SlotRows(NamedTuple):
    """A slot's share of the batch: its rows and the batch index of its output row (-1: none)."""

    slot: Slot
    n: int
    out: int


def assemble(slots: Sequence[Slot], budget: int, cont_batching: bool = True) -> tuple[Batch, list[SlotRows]]:
    """The batch for this iteration and each slot's share; `budget` caps the prompt rows.
    A generating slot contributes its sampled token and then its draft (engine/serve/slot_spec.py)."""
    b, parts = Batch(), []
    for s in slots:
        if s.state is SlotState.GENERATING and s.gen is not None:
            parts.append(SlotRows(s, 1 + len(s.draft.tokens), b.n_tokens))
            b.add(s.gen.sampled, len(s.cache), s.id, True, "g")
            for i, t in enumerate(s.draft.tokens):  # speculative: each drafted token, an output each
                b.add(t, len(s.cache) + 1 + i, s.id, True, "d")
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
