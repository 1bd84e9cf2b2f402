"""The middle of the server's step: a plan run on the context, and its output rows sampled.

The scheduler (engine/serve/scheduler.py) decides which rows go into the iteration's batch; the
runner owns everything that touches the context for it: the `decode` call, what gives way when
the KV cache has no cells for the batch (drafts, then idle sequences' cells, then half of the
prompt rows, then the slot holding the most cells), and the sampling of every output row: the
rows whose chains batch in one pass over all of them (engine/sampling/batched.py; each token then
goes through its slot's `Generation` as a drawn one would), the others by their slot's
`Generation` alone (a grammar, a budget, log-probs, a draft verified, engine/serve/slot_spec.py). It emits no event and
releases no slot: what it did is the plan (rebuilt in place) and the `Outcome` it returns, which
the scheduler's post-process turns into events. `EngineDown` (a lost tensor-parallel rank)
propagates: nothing can run any more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ubatch.engine.context.context import Context
from ubatch.engine.errors import EngineDown, EngineError, ErrorKind
from ubatch.engine.generation.generation import Generation, Step
from ubatch.engine.grammar import GrammarError
from ubatch.engine.kv.memory import DecodeError, DecodeStatus
from ubatch.engine.sampling.batched import Row, sample_rows
from ubatch.engine.serve.prefix_index import PrefixIndex
from ubatch.engine.serve.prompt_progress import advance_prompt
from ubatch.engine.serve.slot import SlotState
from ubatch.engine.serve.slot_batch import Plan, halved_budget, victim
from ubatch.engine.serve.slot_spec import drop_drafts, verify_slot
from ubatch.engine.serve.stats import SchedulerStats
from ubatch.engine.serve.task import decode_failure
from ubatch.engine.spec.speculative import Speculator


@dataclass(slots=True)
class Outcome:
    """What a plan's run gave, per part of the plan as decoded: the steps its slot sampled ([]
    without an output row) or the error that ends its task. `decoded` False: no decode happened
    (the batch emptied, or `failure` ends every part's task)."""

    decoded: bool
    ms: float = 0.0
    n_ubatch: int = 0  # the context's ubatch count after the decode
    results: list[list[Step] | EngineError] = field(default_factory=list)
    failure: EngineError | None = None


class Runner:
    def __init__(
        self, ctx: Context, prefixes: PrefixIndex, stats: SchedulerStats, speculator: Speculator | None
    ) -> None:
        self.ctx, self.prefixes, self.stats, self.speculator = ctx, prefixes, stats, speculator

    def run(self, plan: Plan) -> Outcome:
        """Decode the plan's batch (rebuilt while the cells run out), then sample its outputs."""
        while True:
            if plan.batch.n_tokens == 0:
                return Outcome(False)
            t0 = time.perf_counter()
            try:
                self.ctx.decode(plan.batch)
                break
            except DecodeError as e:
                plan.retries += 1
                if e.code is not DecodeStatus.NO_KV_SLOT:
                    return Outcome(False, failure=decode_failure(e))
                self._give_way(plan, e)
            except EngineDown:  # a lost rank: nothing can run any more; the engine loop answers 503 and stops
                raise
            except Exception as e:
                return Outcome(False, failure=decode_failure(e))
        ms = (time.perf_counter() - t0) * 1e3
        return Outcome(True, ms, len(self.ctx.records), self._sample(plan))

    def _give_way(self, plan: Plan, e: DecodeError) -> None:
        """No cells for the batch: give up the cheapest thing that frees some, then rebuild it."""
        if drop_drafts(plan.slots):
            pass
        elif self.prefixes.evict_idle():
            self.stats.n_evictions += 1
        elif (budget := halved_budget(plan.parts, plan.batch.n_tokens)) is not None:
            plan.budget = budget
        else:  # its cells go now so the retry has them; the post-process fails its task
            s = victim(plan.parts)
            s.forget(self.ctx.memory)
            plan.given_up.append((s, decode_failure(e)))
        plan.reassemble()

    def _sample(self, plan: Plan) -> list[list[Step] | EngineError]:
        """Each part's rows are now cells of its slot; the output rows sampled, the common
        chains in one pass over all of them (engine/sampling/batched.py), the rest slot by slot."""
        out_row = {b: i for i, b in enumerate(self.ctx.output_ids)}
        logits = self.ctx.logits
        for s, n, _ in plan.parts:
            assert s.gen is not None  # set when the task took the slot
            if s.state is SlotState.GENERATING:
                s.gen.decoded()
            else:
                advance_prompt(s, n)
        results: list[list[Step] | EngineError] = [[] for _ in plan.parts]
        together: list[tuple[int, Generation, Row]] = []
        for j, (s, _, out) in enumerate(plan.parts):
            gen = s.gen
            assert gen is not None
            if out < 0:
                continue
            r = out_row[out]
            row = None if s.draft.tokens or logits.device.type != "cpu" else gen.row(r)
            if row is not None:
                together.append((j, gen, row))
                continue
            try:
                if s.draft.tokens and self.speculator is not None:
                    rows = logits[r : r + 1 + len(s.draft.tokens)]
                    results[j] = verify_slot(s, rows, self.ctx.memory, self.speculator, len(self.ctx.records))
                else:
                    results[j] = [gen.sample(logits[r])]
            except GrammarError as e:  # too ambiguous to follow, or no way left: the request's grammar
                results[j] = EngineError(ErrorKind.INVALID_REQUEST, f"the grammar could not be followed: {e}")
            except EngineDown:  # a rejected draft's cells are removed on every rank: one may be gone
                raise
            except Exception as e:
                results[j] = _sampling_failed(e)
        if together:
            self._sample_together(logits, together, results)
        return results

    def _sample_together(
        self, logits: torch.Tensor, together: list[tuple[int, Generation, Row]], results: list[list[Step] | EngineError]
    ) -> None:
        t0 = time.perf_counter()
        try:
            tokens = sample_rows(logits, [row for _, _, row in together], self.ctx.ops.argmax_rows)
        except Exception as e:
            for j, _, _ in together:
                results[j] = _sampling_failed(e)
            return
        ms = (time.perf_counter() - t0) * 1e3 / len(together)
        for (j, gen, _), tok in zip(together, tokens, strict=True):
            try:
                results[j] = [gen.took(tok, ms)]
            except Exception as e:
                results[j] = _sampling_failed(e)


def _sampling_failed(e: Exception) -> EngineError:
    return EngineError(ErrorKind.INTERNAL, f"sampling failed: {e}")
