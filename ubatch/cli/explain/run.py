"""Run a request for `ubatch explain`: the prompts as the server's scheduler would decode them
together (engine/serve/scheduler.py, driven one iteration at a time in this thread), with a Recorder
on the context, then the memory plan and the -ub what-if (cli/explain/whatif.py).

Everything the explanation shows comes from the engine's own records: the derivation steps from
`derive`, the calls and ubatches from `Context.observers`, the plan from engine/context/report.py. The run serves `ubatch explain` alone, so it sits in
cli/explain/, above the engine whose records it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ubatch.cli.explain.whatif import WhatIf, what_if
from ubatch.engine.context.context import Context
from ubatch.engine.context.report import MemoryPlan, memory_plan
from ubatch.engine.errors import UbatchError
from ubatch.engine.explain.mask import MaskGrid
from ubatch.engine.explain.observer import CallView, Recorder
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams, CParams
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.serve.stats import PrefixReuse
from ubatch.engine.serve.task import Failed, Final, Task, TaskParams
from ubatch.engine.spec.speculative import SpecStats, Speculator


class ExplainError(UbatchError):
    """A request that cannot run as asked: what failed and which flag to change (one line)."""


@dataclass(slots=True)
class Request:
    prompts: list[list[int]]  # token ids, one list per sequence
    # what each sequence asks, as a server request's (-n, sampling, --ignore-eos, -l, the grammar)
    task: TaskParams = field(default_factory=lambda: TaskParams(n_predict=4))
    n_slots: int = 0  # 0: one slot per prompt
    # the Speculator for the target context (engine/spec/speculative.py), or None: speculation off
    speculator: Callable[[Context], Speculator | None] | None = None
    lora: dict[int, float] = field(default_factory=dict)  # the model's adapters every sequence applies


@dataclass(slots=True)
class SequenceResult:
    slot: int  # the slot, i.e. the sequence id its rows carry
    n_prompt: int
    n_generated: int
    text: str
    stop_type: str
    n_cached: int = 0  # prompt tokens not computed: found in cells or host memory
    n_shared: int = 0  # ... of which another sequence's cells held (shared, or copied between streams)
    shared_from: int = -1  # that sequence (-1: none)


@dataclass(slots=True)
class Explanation:
    params: ContextParams  # as asked
    cparams: CParams  # as derived (with the steps that changed a value)
    n_ctx_slot: int  # what one sequence may hold (the scheduler's n_ctx_seq, capped by n_ctx_train)
    n_slots: int
    sequences: list[SequenceResult]
    calls: list[CallView]
    mask: list[MaskGrid]
    mask_ubatch: int
    plan: MemoryPlan
    what_if: list[WhatIf]
    warnings: list[str] = field(default_factory=list)
    spec: SpecStats | None = None  # what speculation did; None when off
    n_cells_shared: int = 0  # KV cells held by more than one sequence when the run ended

    @property
    def n_ubatches(self) -> int:
        return sum(len(c.ubatches) for c in self.calls)


def check_prompts(req: Request, cp: CParams, n_ctx_slot: int, n_ctx_train: int) -> None:
    """Refuse a prompt the slot cannot hold (llama-server's rule: fewer tokens than n_ctx),
    naming the flag that would make it fit."""
    for i, p in enumerate(req.prompts):
        if len(p) < n_ctx_slot:
            continue
        if n_ctx_slot == n_ctx_train and n_ctx_train < cp.n_ctx_seq:
            fix = f"the model was trained for {n_ctx_train} tokens: shorten the prompt"
        elif cp.n_seq_max > 1 and not cp.kv_unified:
            fix = f"raise -c (n_ctx is split over -np {cp.n_seq_max} sequences), or use -kvu (one shared cache)"
        else:
            fix = "raise -c"
        raise ExplainError(
            f"prompt {i + 1} has {len(p)} tokens but a sequence holds {n_ctx_slot} (n_ctx_seq = {cp.n_ctx_seq}) "
            f"and needs room for one more: {fix}"
        )


def explain_request(model: Model, params: ContextParams, req: Request, sub_ubatches: tuple[int, ...]) -> Explanation:
    """Run `req` for real on a fresh context and explain it; `sub_ubatches`: the -ub values of
    the what-if table besides the given one."""
    if not req.prompts:
        raise ExplainError("nothing to explain: give at least one -p")
    n_slots = req.n_slots or len(req.prompts)
    ctx = Context(model, params)
    ctx.set_adapters(req.lora)
    spec = req.speculator(ctx) if req.speculator is not None else None
    sched = Scheduler(ctx, n_slots, speculator=spec)
    check_prompts(req, ctx.cparams, sched.n_ctx_slot, model.hparams.n_ctx_train)
    rec = Recorder.attach(ctx)
    events: list[object] = []
    tasks = []
    for i, p in enumerate(req.prompts):
        tasks.append(Task(i, list(p), replace(req.task), events.append, index=i))
        sched.accept(tasks[-1])
    limit = 4 * (sum(map(len, req.prompts)) + len(req.prompts) * max(req.task.n_predict, sched.n_ctx_slot)) + 16
    for _ in range(limit):
        sched.step()
        if not sched.queue and not any(s.busy for s in sched.slots):
            break
    rec.detach()
    sequences = []
    for t in tasks:
        ev = next((e for e in events if isinstance(e, Final | Failed) and e.task is t), None)
        if isinstance(ev, Failed):
            raise ExplainError(run_failure(t.index, ev.error.message))
        if ev is None:
            raise ExplainError(f"prompt {t.index + 1} did not finish")
        r = next((r.reuse for r in sched.releases if r.task == t.id), PrefixReuse())
        sequences.append(
            SequenceResult(
                ev.id_slot, ev.n_prompt, ev.n_decoded, ev.content, ev.stop_type, r.total, r.n_shared, r.source
            )
        )
    return Explanation(
        params,
        ctx.cparams,
        sched.n_ctx_slot,
        n_slots,
        sequences,
        rec.calls,
        rec.mask,
        rec.mask_ubatch,
        memory_plan(ctx),
        what_if(model, params, rec.calls, sub_ubatches),
        [*ctx.cparams.warnings, *sched.warnings],
        spec.stats if spec is not None else None,
        sched.n_cells_shared,
    )


def run_failure(index: int, message: str) -> str:
    """A failed sequence as one line with the flag to change."""
    if "Context size has been exceeded" in message or "memory slot" in message:
        return f"prompt {index + 1}: the KV cache ran out of cells ({message.rstrip('.')}): raise -c, or lower -n"
    return f"prompt {index + 1}: {message}"
