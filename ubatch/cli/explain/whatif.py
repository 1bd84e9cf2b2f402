"""The -ub what-if of `ubatch explain`: the same decode calls under another n_ubatch.

The batches a request produces depend on n_batch and the scheduler, not on n_ubatch, so the
recorded batches are replayed into a fresh KV memory of the other configuration (cells only: its
K/V tensors live on the meta device) through the engine's own `KVMemory.init_batch`, which picks
the split (split_simple / split_equal) and checks each ubatch finds cells, exactly as a decode
does. The compute buffer and KV sizes come from the planner (`plan_for`); nothing is reloaded.
It serves `ubatch explain` alone, so it sits in cli/explain/.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ubatch.engine.context.report import plan_for
from ubatch.engine.explain.observer import CallView
from ubatch.engine.kv.memory import DecodeError, KVMemory
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams, derive


@dataclass(slots=True)
class WhatIf:
    n_ubatch_asked: int  # the -ub of this row
    n_ubatch: int  # after derive's clamps
    given: bool  # the row of the -ub the request ran with
    n_passes: int  # forward passes the recorded calls need (-1: they do not fit, see error)
    compute_bytes: int
    kv_bytes: int
    total_bytes: int
    rule: str  # why derive changed n_ubatch, "" if it did not
    error: str = ""


def replay(memory: KVMemory, calls: list[CallView], n_ubatch: int) -> int:
    """Forward passes the calls need in `memory`; a DecodeError if one does not fit."""
    passes = 0
    for call in calls:
        b = call.batch
        # a sequence's rows continue right after its cells (Context.validate's rule), so cells at
        # or past its first position here were removed before this call (a rejected draft)
        first: dict[int, int] = {}
        for sids, p in zip(b.seq_id, b.pos):
            for s in sids:
                first[s] = min(first.get(s, p), p)
        for s, p in first.items():
            memory.seq_rm(s, p, -1)
        ubs = memory.init_batch(b, n_ubatch)
        for ub in ubs:
            memory.place(ub)
        passes += len(ubs)
    return passes


def what_if(model: Model, params: ContextParams, calls: list[CallView], others: tuple[int, ...]) -> list[WhatIf]:
    """One row per -ub value: the given one first, then `others` (each once)."""
    hp, rows = model.hparams, []
    for u in dict.fromkeys((params.n_ubatch, *others)):
        p = replace(params, n_ubatch=u)
        cp = derive(p, hp)
        rule = next((s.rule for s in reversed(cp.steps) if s.name == "n_ubatch"), "")
        error = ""
        try:
            n_passes = replay(KVMemory.build(hp, cp, device="meta"), calls, cp.n_ubatch)
        except DecodeError as e:
            n_passes, error = -1, str(e)
        plan = plan_for(model, p)
        rows.append(
            WhatIf(
                u,
                cp.n_ubatch,
                u == params.n_ubatch,
                n_passes,
                plan.compute_bytes,
                plan.kv_bytes,
                plan.total_bytes,
                rule,
                error,
            )
        )
    return rows
