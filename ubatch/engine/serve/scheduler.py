"""The server's scheduler: -np slots, continuous batching, one `Context.decode` per iteration.

The scheduler decides; it owns no thread. Slot i owns sequence id i. Each iteration, `step`
(llama-server's update_slots) is three calls, as nano-vllm's:
  1. `schedule() -> Plan`: frees the slots whose client went away, starts queued tasks on idle
     slots (reusing the longest cached prefix of the prompt: the slot's own cells, another
     sequence's, or host memory; engine/serve/prefix_index.py), shifts full contexts if allowed,
     and assembles ONE batch: a row from every generating slot (its last sampled token and its
     draft), then prompt chunks of prefilling slots in slot order until n_batch rows
     (engine/serve/slot_batch.py);
  2. `runner.run(plan) -> Outcome` (engine/serve/runner.py): decodes it; on "no KV slot" drops
     drafts, purges idle caches, postpones prompt rows or gives up a slot, and retries; then
     samples the output rows (the common chains in one pass, engine/sampling/batched.py) and
     hands each token to its slot's Generation (engine/generation/generation.py);
  3. `postprocess(plan, outcome)`: emits the events, records the decode and ends the tasks
     that are done (finished, failed or cancelled).
The server's engine loop (engine/serve/engine_loop.py) calls `step` on its thread, with the
tasks that came in through its door (`accept`); `ubatch explain` calls it directly. Nothing here
prints: callers read events, `records` (per iteration), `releases` (per ended task) and `stats`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum

from ubatch.engine.context.context import Context
from ubatch.engine.errors import EngineError, ErrorKind
from ubatch.engine.generation.generation import Generation, GenerationParams, Step
from ubatch.engine.sampling.chain import Sampler
from ubatch.engine.serve.host_cache import DEFAULT_CACHE_RAM_MIB, HostCache
from ubatch.engine.serve.prefix_index import PrefixIndex
from ubatch.engine.serve.prompt_progress import prompt_started, report
from ubatch.engine.serve.runner import Outcome, Runner
from ubatch.engine.serve.slot import Slot, SlotState
from ubatch.engine.serve.slot_batch import Plan, assemble, record_of
from ubatch.engine.serve.slot_spec import plan_drafts
from ubatch.engine.serve.stats import IterationRecord, PrefixReuse, ReleaseRecord, SchedulerStats
from ubatch.engine.serve.task import Final, Job, Partial, Task, context_error
from ubatch.engine.spec.speculative import Speculator

__all__ = ["IterationRecord", "ReleaseRecord", "Scheduler", "SchedulerStats", "Slot", "SlotEvent", "SlotState"]


class SlotEvent(StrEnum):
    """What the scheduler's listener is told about a slot (llama-server's slot log lines)."""

    LAUNCH = "launch"  # a task took the slot
    RELEASE = "release"  # its task ended


class Scheduler:
    def __init__(
        self,
        ctx: Context,
        n_slots: int,
        *,
        context_shift: bool = False,
        cache_reuse: int = 0,
        slot_prompt_similarity: float = 0.1,
        cont_batching: bool = True,
        history: int = 256,
        speculator: Speculator | None = None,
        prefix_sharing: bool = True,
        cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB,
    ) -> None:
        cp, hp = ctx.cparams, ctx.model.hparams
        if not 1 <= n_slots <= cp.n_seq_max:
            raise ValueError(f"n_slots = {n_slots} needs a context with n_seq_max >= {n_slots}")
        self.ctx, self.vocab = ctx, ctx.model.vocab
        self.n_ctx_slot = min(cp.n_ctx_seq, hp.n_ctx_train)
        self.slots = [Slot(i, self.n_ctx_slot) for i in range(n_slots)]
        self.warnings: list[str] = []
        can_shift = ctx.memory.can_shift
        if (context_shift or cache_reuse) and not can_shift:
            self.warnings.append(
                "ctx_shift / cache_reuse is not supported by this context (a sliding-window cache smaller than the context; use --swa-full), disabling"
            )
        self.context_shift = context_shift and can_shift
        self.cache_reuse = cache_reuse if can_shift else 0
        self.similarity = slot_prompt_similarity
        self.cont_batching = cont_batching
        self.speculator = speculator  # drafts verified with each generating slot's row
        for s in self.slots:
            s.speculative = speculator is not None
        self.iteration = 0
        self.queue: deque[Task] = deque()  # accepted, waiting for a slot
        self.stats = SchedulerStats()
        self.records: deque[IterationRecord] = deque(maxlen=history)
        self.releases: deque[ReleaseRecord] = deque(maxlen=history)
        # prompts reuse prefixes held by any sequence (shared cells with -kvu, copied rows across
        # streams otherwise) and by host memory (cache_ram_mib MiB, -1 no limit, 0 off)
        self.host = HostCache(cache_ram_mib)
        self.prefixes = PrefixIndex(ctx, self.slots, self.host, prefix_sharing)
        self.runner = Runner(ctx, self.prefixes, self.stats, speculator)  # the decode and the sampling
        # called on the engine thread as listener(event, slot): for logging only
        self.listener: Callable[[SlotEvent, Slot], None] | None = None

    # -- what the engine loop drives ----------------------------------------------------------------
    def accept(self, task: Job) -> bool:
        """Queue a completion task for a slot (other kinds are a side runner's)."""
        if not isinstance(task, Task):
            return False
        self.queue.append(task)
        return True

    @property
    def busy(self) -> bool:
        """Work that needs further iterations: a queued task or a busy slot."""
        return bool(self.queue) or any(s.busy for s in self.slots)

    @property
    def n_waiting(self) -> int:
        return len(self.queue)

    def fail(self, err: EngineError) -> None:
        """An iteration raised: fail the tasks on the slots (queued ones wait for the next)."""
        for s in self.slots:
            self._fail(s, err)

    def drain(self, err: EngineError) -> None:
        """Shutdown: a generating slot ends as if it reached n_predict (stop_type "limit", so
        finish_reason "length", with the text so far); a task still reading its prompt or
        waiting for a slot has nothing to return and gets `err`."""
        self._reap_cancelled()
        while self.queue:
            self.queue.popleft().fail(err)
        for s in self.slots:
            if s.state is SlotState.GENERATING:
                self._finish(s, "limit", "shutdown")
            else:
                self._fail(s, err)

    # -- one iteration: schedule, run, post-process -------------------------------------------
    def step(self) -> IterationRecord | None:
        """Run one iteration; returns its record, or None when there was nothing to decode."""
        plan = self.schedule()
        if plan is None:
            return None
        return self.postprocess(plan, self.runner.run(plan))

    def schedule(self) -> Plan | None:
        """Decide the iteration: cancelled tasks reaped, queued ones started, full contexts
        shifted, drafts planned, the batch assembled; None when there is nothing to decode."""
        self.iteration += 1
        self._reap_cancelled()
        self._launch_queued()
        for s in self.slots:
            if s.state is SlotState.GENERATING and s.gen is not None:
                if not self.prefixes.separate_for_shift(s):
                    msg = "no free KV cells to give a shifting sequence its own copy of a shared prefix; raise -c"
                    self._fail(s, EngineError(ErrorKind.INTERNAL, msg))
                    continue
                n_keep = min(s.gen.params.n_keep, len(s.cache) - 1)
                if s.gen.make_room(self.ctx.memory, s.id):  # cells after n_keep re-rotated: inexact
                    s.taint = n_keep if s.taint < 0 else min(s.taint, n_keep)
        budget = self.ctx.cparams.n_batch
        plan_drafts(self.slots, self.speculator, budget)
        batch, parts = assemble(self.slots, budget, self.cont_batching)
        if batch.n_tokens == 0:
            return None
        return Plan(self.iteration, self.slots, batch, parts, budget, self.cont_batching)

    def postprocess(self, plan: Plan, out: Outcome) -> IterationRecord | None:
        """The run's consequences: the tasks it gave up or that failed end, the decode is
        recorded, prompts report progress, sampled tokens stream and finished tasks end."""
        for s, why in plan.given_up:
            self._fail(s, why)
        if not out.decoded:
            if (err := out.failure) is not None:
                for s, _, _ in plan.parts:
                    self._fail(s, err)
            return None
        rec = record_of(plan.parts, self.iteration, plan.batch, out.n_ubatch, out.ms, plan.retries, len(self.queue))
        self.stats.count_decode(rec, sum(s.busy for s in self.slots))
        self.records.append(rec)
        now = time.perf_counter()
        for (s, _, o), res in zip(plan.parts, out.results, strict=True):
            if s.state is SlotState.PROCESSING_PROMPT:
                report(s)  # its prompt_progress event (engine/serve/prompt_progress.py)
            self.stats.n_tokens_max = max(self.stats.n_tokens_max, len(s.cache))
            if o < 0:
                continue
            if s.state is SlotState.PROCESSING_PROMPT:
                s.state, s.t_prompt_done = SlotState.GENERATING, now
                self.stats.prompt_done(s.n_prompt_done, (now - s.t_start) * 1e3)
            if isinstance(res, EngineError):
                self._fail(s, res)
                continue
            for step in res:
                self._emit(s, step)
        return rec

    def _emit(self, s: Slot, step: Step) -> None:
        """One sampled token of the slot: stream it, finish on a stop rule."""
        task, gen = s.task, s.gen
        if task is None or gen is None:  # the slot finished on an earlier token of this step
            return
        s.t_last = time.perf_counter()
        p = task.params
        if p.stream:
            tm = s.timings() if p.timings_per_token else None
            task.emit(Partial(task, s.id, step.token, step.text, gen.n_decoded, len(task.prompt), step.prob, tm))
        if step.done:
            self._finish(s)

    # -- starting a task ----------------------------------------------------------------------------
    def _launch_queued(self) -> None:
        waiting: deque[Task] = deque()
        while self.queue:
            task = self.queue.popleft()
            lora = self._lora(task)
            if task.params.cache_prompt and self.prefixes.should_wait(task.prompt, lora):
                self.stats.n_waited_prefix += 1
                waiting.append(task)
                continue
            slot = self.prefixes.pick_slot(task.prompt, task.params.id_slot, self.similarity, lora)
            if slot is None:
                waiting.append(task)
            else:
                self._launch(slot, task)
        self.queue = waiting

    def _lora(self, task: Task) -> tuple[tuple[int, float], ...]:
        """The LoRA adapters a task applies: its own `lora` (unlisted ones at 0, as llama-server's
        construct_lora_list), else the server's scales as they are when it starts."""
        scales = self.ctx.lora if task.params.lora is None else task.params.lora
        return tuple((i, v) for i, v in sorted(scales.items()) if v != 0.0)

    def _launch(self, s: Slot, task: Task) -> None:
        prompt, p = task.prompt, task.params
        if (err := context_error(len(prompt), s.n_ctx)) is not None:
            task.fail(err)
            return
        s.start(task)
        n_keep = (len(prompt) if p.n_keep < 0 else p.n_keep) + int(self.vocab.add_bos)
        params = GenerationParams(
            n_predict=p.n_predict,
            stop=p.stop,
            ignore_eos=p.ignore_eos,
            logit_bias=p.logit_bias,
            n_probs=p.n_probs,
            ctx_shift=self.context_shift,
            n_keep=min(s.n_ctx - 4, n_keep),
            n_discard=p.n_discard,
            grammar=p.grammar,
            special=p.special,
            preserved=p.preserved,
        )
        s.gen = Generation(self.vocab, Sampler(p.sampling, s.n_ctx, self.vocab), params, s.n_ctx, s.cache)
        if not prompt:  # llama-server answers an empty prompt at once
            s.t_prompt_done = s.t_last = s.t_start
            self._finish(s)
            return
        reuse = (p.n_cache_reuse or self.cache_reuse) if self.cache_reuse else 0
        lora = self._lora(task)
        if p.lora is None:  # what it applies, as /slots and its generation_settings show
            p.lora = {i: v for i, v in self.ctx.lora.items()}
        self.ctx.set_seq_adapters(s.id, dict(lora))  # the slot's rows apply them, whatever the others do
        s.reuse = self.prefixes.reuse(s, prompt, p.cache_prompt, reuse, lora)
        s.n_prompt_cache = s.i_prompt = s.reuse.total
        s.gen.accept_prompt(prompt)
        prompt_started(s, self.stats)
        self._notify(SlotEvent.LAUNCH, s)

    # -- how a task ends: finished, failed, cancelled -------------------------------------------------
    def _finish(self, s: Slot, stop_type: str = "", reason: str = "") -> None:
        """The task's Final event; `stop_type` / `reason` override the generation's own (shutdown)."""
        task, gen = s.task, s.gen
        assert task is not None and gen is not None
        tail = gen.finish()
        content = tail if task.params.stream else gen.text
        task.emit(
            Final(
                task,
                s.id,
                content,
                tuple(gen.tokens),
                gen.n_decoded,
                len(task.prompt),
                len(s.cache),
                stop_type or s.stop_type,
                gen.stopping_word,
                gen.truncated,
                gen.has_new_line,
                s.timings(),
                tuple(gen.probs),
            )
        )
        self.stats.generation_done(gen.n_decoded, (s.t_last - s.t_prompt_done) * 1e3)
        self._release(s, reason or s.stop_type)

    def _fail(self, s: Slot, err: EngineError) -> None:
        """Error the slot's task, free its cells (llama-server clears a failed slot's KV)."""
        if s.task is None or not s.busy:
            return
        s.task.fail(err)
        s.forget(self.ctx.memory)
        self._release(s, "error")

    def _reap_cancelled(self) -> None:
        for s in self.slots:
            if s.busy and s.task is not None and s.task.cancelled:
                self.stats.n_cancelled += 1
                s.forget(self.ctx.memory)
                self._release(s, "cancelled")
        if any(t.cancelled for t in self.queue):
            self.stats.n_cancelled += sum(t.cancelled for t in self.queue)
            self.queue = deque(t for t in self.queue if not t.cancelled)

    def _release(self, s: Slot, reason: str) -> None:
        task = s.task
        self.releases.append(
            ReleaseRecord(
                s.id,
                task.id if task else -1,
                reason,
                self.iteration,
                task.cancel_iteration if task else -1,
                PrefixReuse(s.reuse.n_own, s.reuse.n_shared, s.reuse.n_ram, s.reuse.source),
            )
        )
        s.last_task, s.task = task, None
        self.ctx.set_seq_adapters(s.id, None)  # a side runner borrowing the slot applies the global scales
        s.state = SlotState.IDLE
        s.t_last_used = time.perf_counter()
        self._notify(SlotEvent.RELEASE, s)

    @property
    def n_cells_shared(self) -> int:
        """KV cells held by more than one sequence right now (each would otherwise be two)."""
        return self.ctx.memory.n_shared

    def _notify(self, kind: SlotEvent, s: Slot) -> None:
        if self.listener is not None:
            try:
                self.listener(kind, s)
            except Exception:  # a logging hook must not break the engine
                pass
