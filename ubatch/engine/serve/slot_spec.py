"""Speculative decoding in the server's iterations: a draft per generating slot before the batch is
assembled, and its verification after the decode.

Every generating slot drafts (engine/spec/speculative.py) within what its context and n_predict allow,
and the drafts of all slots together stay within n_batch rows next to the slots' own rows, so the
verification of every slot rides in the same decode call as everything else of that iteration.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ubatch.engine.generation.generation import Step
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.serve.slot import Slot, SlotState
from ubatch.engine.spec.speculative import Draft, Speculator, n_draft_max
from ubatch.engine.spec.verify import verify


def plan_drafts(slots: list[Slot], spec: Speculator | None, n_batch: int) -> None:
    """Give each generating slot its draft for this iteration (none without a speculator)."""
    room = n_batch - sum(1 for s in slots if s.state is SlotState.GENERATING)
    for s in slots:
        s.draft = Draft([])
        if spec is None or s.gen is None or s.state is not SlotState.GENERATING or room <= 0:
            continue
        g = s.gen
        n = min(room, n_draft_max(s.n_ctx, len(s.cache), g.params.n_predict, g.n_decoded, spec.n_max))
        if n > 0:
            s.draft = spec.draft(s.id, s.cache, g.sampled, n)
            room -= len(s.draft.tokens)


def drop_drafts(slots: Sequence[Slot]) -> bool:
    """No room in the KV cache: verify nothing this iteration (True if there was a draft)."""
    had = any(s.draft.tokens for s in slots)
    for s in slots:
        s.draft = Draft([])
    return had


def verify_slot(s: Slot, rows: torch.Tensor, memory: KVMemory, spec: Speculator, n_ubatch: int) -> list[Step]:
    """The slot's accepted tokens from its rows [sampled, d1..dk]; the rejected cells are freed."""
    assert s.gen is not None
    v = verify(s.gen, rows, s.draft, memory, s.id)
    s.spec.add(v.n_drafted, v.n_accepted)
    spec.stats.add(v.n_drafted, v.n_accepted, n_ubatch)
    s.draft = Draft([])
    return v.steps
