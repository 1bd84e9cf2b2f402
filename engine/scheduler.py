"""The server's scheduler: -np slots, continuous batching, one `Context.decode` per iteration.

Slot i owns sequence id i. Each iteration (llama-server's update_slots):
  1. free the slots whose client went away, start queued tasks on idle slots (reusing the
     longest common prefix of the slot's cached tokens), shift full contexts if allowed;
  2. assemble ONE batch: a row from every generating slot (its last sampled token), then
     prompt chunks of prefilling slots in slot order until n_batch rows;
  3. decode it; on "no KV slot" purge idle caches or postpone prompt rows and retry;
  4. sample per slot from its output row, apply the stop rules, emit events.
The loop runs in its own thread; `submit` and `cancel` are safe to call from any thread.
Nothing here prints: callers read events, `records` (per iteration) and `stats`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from .batch import Batch, common_prefix
from .context import Context
from .memory import DecodeError
from .sampling import Sampler
from .server_task import (Failed, Final, Partial, RequestError, Task, Timings, TokenProb,
                          find_partial_stop)
from .vocab import TokenStreamer


class SlotState(Enum):
    IDLE = "idle"
    PROCESSING_PROMPT = "processing_prompt"
    GENERATING = "generating"


@dataclass(slots=True)
class Slot:
    id: int
    n_ctx: int
    state: SlotState = SlotState.IDLE
    task: Task | None = None
    last_task: Task | None = None
    cache: list[int] = field(default_factory=list)  # tokens whose K/V sit in the cache, by position
    i_prompt: int = 0  # next prompt token to evaluate
    sampler: Sampler | None = None
    streamer: TokenStreamer | None = None
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (token ids, additive biases)
    sampled: int = -1  # last sampled token: the next row this slot contributes
    generated: list[int] = field(default_factory=list)
    text: str = ""
    n_sent: int = 0  # characters of `text` already sent
    probs: list[TokenProb] = field(default_factory=list)
    n_decoded: int = 0
    n_prompt_cache: int = 0
    n_prompt_done: int = 0
    stop_type: str = "none"
    stopping_word: str = ""
    truncated: bool = False
    has_new_line: bool = False
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    t_last: float = 0.0
    t_last_used: float = 0.0

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.IDLE

    def timings(self) -> Timings:
        t_gen = max(self.t_last - self.t_prompt_done, 1e-6) if self.n_decoded else 0.0
        return Timings(self.n_prompt_cache, self.n_prompt_done, (self.t_prompt_done - self.t_start) * 1e3,
                       self.n_decoded, t_gen * 1e3)


@dataclass(slots=True)
class IterationRecord:
    """What one decode call carried: rows per sequence id, generation vs prompt rows."""

    index: int
    n_tokens: int
    n_outputs: int
    rows: dict[int, int]  # seq id -> rows in this decode
    n_gen: int
    n_prompt: int
    n_ubatch: int
    ms: float
    retries: int = 0
    n_queued: int = 0  # tasks waiting for a slot when this batch was assembled


@dataclass(slots=True)
class ReleaseRecord:
    slot: int
    task: int
    reason: str  # "eos" | "word" | "limit" | "cancelled" | "error"
    iteration: int
    cancel_iteration: int = -1


@dataclass(slots=True)
class SchedulerStats:
    """llama-server's server_metrics plus the batching counters this project is about."""

    t_start: float = field(default_factory=time.time)
    n_prompt_tokens_total: int = 0
    t_prompt_ms_total: float = 0.0
    n_predicted_total: int = 0
    t_predicted_ms_total: float = 0.0
    n_prompt_tokens: int = 0  # bucket since the last /metrics read
    t_prompt_ms: float = 0.0
    n_predicted: int = 0
    t_predicted_ms: float = 0.0
    n_tokens_max: int = 0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    n_rows_total: int = 0
    n_ubatch_total: int = 0
    decodes_by_n_seqs: Counter[int] = field(default_factory=Counter)
    n_requests: int = 0
    n_cancelled: int = 0
    n_errors: int = 0

    def reset_bucket(self) -> None:
        self.n_prompt_tokens = self.n_predicted = 0
        self.t_prompt_ms = self.t_predicted_ms = 0.0


class Scheduler:
    def __init__(self, ctx: Context, n_slots: int, *, context_shift: bool = False,
                 cache_reuse: int = 0, slot_prompt_similarity: float = 0.1,
                 cont_batching: bool = True, history: int = 256) -> None:
        cp, hp = ctx.cparams, ctx.model.hparams
        if not 1 <= n_slots <= cp.n_seq_max:
            raise ValueError(f"n_slots = {n_slots} needs a context with n_seq_max >= {n_slots}")
        self.ctx, self.vocab = ctx, ctx.model.vocab
        self.n_ctx_slot = min(cp.n_ctx_seq, hp.n_ctx_train)
        self.slots = [Slot(i, self.n_ctx_slot) for i in range(n_slots)]
        self.warnings: list[str] = []
        can_shift = ctx.memory.can_shift
        if (context_shift or cache_reuse) and not can_shift:
            self.warnings.append("ctx_shift / cache_reuse is not supported by this context (a sliding-"
                                 "window cache smaller than the context; use --swa-full), disabling")
        self.context_shift = context_shift and can_shift
        self.cache_reuse = cache_reuse if can_shift else 0
        self.similarity = slot_prompt_similarity
        self.cont_batching = cont_batching
        self.stats = SchedulerStats()
        self.records: deque[IterationRecord] = deque(maxlen=history)
        self.releases: deque[ReleaseRecord] = deque(maxlen=history)
        self.iteration = 0
        self.queue: deque[Task] = deque()  # accepted, waiting for a slot (only the loop touches it)
        self._incoming: deque[Task] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # called on the engine thread as listener("launch" | "release", slot): for logging only
        self.listener: Callable[[str, Slot], None] | None = None
        eog = sorted(self.vocab.eog)
        self._eog = torch.tensor(eog, dtype=torch.long) if eog else None

    # -- thread API ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ubatch-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, task: Task) -> None:
        with self._cv:
            self.stats.n_requests += 1
            self._incoming.append(task)
            self._cv.notify()

    def cancel(self, task: Task) -> None:
        """The client went away: its slot and cells are freed at the start of the next iteration."""
        if task.cancelled:
            return
        with self._cv:
            task.cancel_iteration = self.iteration
            task.cancelled = True
            self._cv.notify()

    @property
    def n_deferred(self) -> int:
        return len(self.queue) + len(self._incoming)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._incoming and not self.queue \
                        and not any(s.busy for s in self.slots):
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a bug in an iteration fails its requests, not the server
                for s in self.slots:
                    if s.busy:
                        self._fail(s, RequestError(f"internal error: {e}", 500, "server_error"))

    # -- one iteration ---------------------------------------------------------------------------
    def step(self) -> IterationRecord | None:
        """Run one iteration; returns its record, or None when there was nothing to decode."""
        with self._cv:
            self.iteration += 1
            self.queue.extend(self._incoming)
            self._incoming.clear()
        self._reap_cancelled()
        self._launch_queued()
        if self.context_shift:
            for s in self.slots:
                if s.state is SlotState.GENERATING and len(s.cache) + 1 >= s.n_ctx:
                    self._shift(s)
        budget, retries = self.ctx.cparams.n_batch, 0
        while True:
            batch, plan = self._assemble(budget)
            if batch.n_tokens == 0:
                return None
            t0 = time.perf_counter()
            try:
                self.ctx.decode(batch)
                break
            except DecodeError as e:
                retries += 1
                if e.code == 1:  # no room in the KV cache
                    if self._purge_idle():
                        continue
                    n_gen = sum(1 for s, n, _ in plan if s.state is SlotState.GENERATING)
                    n_prompt = batch.n_tokens - n_gen
                    if n_prompt > 1 or (n_prompt == 1 and n_gen > 0):
                        budget = n_gen + n_prompt // 2  # halve the prompt rows, as llama-server
                        continue
                    # nothing left to postpone: the slot holding the most cells gives way
                    victim = max((s for s, _, _ in plan), key=lambda s: len(s.cache))
                    self._fail(victim, RequestError("Context size has been exceeded.", 500, "server_error"))
                    continue
                for s, _, _ in plan:
                    self._fail(s, RequestError(f"Invalid input batch. ({e})", 500, "server_error"))
                return None
            except Exception as e:
                for s, _, _ in plan:
                    self._fail(s, RequestError(f"Compute error. ({e})", 500, "server_error"))
                return None
        rec = self._record(batch, plan, (time.perf_counter() - t0) * 1e3, retries)
        self._after_decode(plan)
        return rec

    def _assemble(self, budget: int) -> tuple[Batch, list[tuple[Slot, int, int]]]:
        """Generation rows first, then prompt chunks in slot order up to `budget` rows.
        The plan lists (slot, rows, batch index of its output row or -1)."""
        b, plan = Batch(), []
        for s in self.slots:
            if s.state is SlotState.GENERATING:
                plan.append((s, 1, b.n_tokens))
                b.add(s.sampled, len(s.cache), s.id, True)
        if not self.cont_batching and b.n_tokens:
            return b, plan
        for s in self.slots:
            if s.state is not SlotState.PROCESSING_PROMPT or b.n_tokens >= budget:
                continue
            prompt = s.task.prompt  # type: ignore[union-attr]
            n = min(len(prompt) - s.i_prompt, budget - b.n_tokens)
            last = s.i_prompt + n == len(prompt)
            pos0 = len(s.cache)
            for j in range(n):
                b.add(prompt[s.i_prompt + j], pos0 + j, s.id, last and j == n - 1)
            plan.append((s, n, b.n_tokens - 1 if last else -1))
        return b, plan

    def _record(self, batch: Batch, plan: list[tuple[Slot, int, int]], ms: float,
                retries: int) -> IterationRecord:
        rows: dict[int, int] = {}
        for s, n, _ in plan:
            rows[s.id] = rows.get(s.id, 0) + n
        n_gen = sum(n for s, n, _ in plan if s.state is SlotState.GENERATING)
        rec = IterationRecord(self.iteration, batch.n_tokens, sum(batch.logits), rows, n_gen,
                              batch.n_tokens - n_gen, len(self.ctx.records), ms, retries,
                              len(self.queue))
        st = self.stats
        st.n_decode_total += 1
        st.n_busy_slots_total += sum(s.busy for s in self.slots)
        st.n_rows_total += batch.n_tokens
        st.n_ubatch_total += rec.n_ubatch
        st.decodes_by_n_seqs[len(rows)] += 1
        self.records.append(rec)
        return rec

    def _after_decode(self, plan: list[tuple[Slot, int, int]]) -> None:
        out_row = {b: i for i, b in enumerate(self.ctx.output_ids)}
        now = time.perf_counter()
        for s, n, out in plan:
            if s.state is SlotState.GENERATING:
                s.cache.append(s.sampled)
            else:
                prompt = s.task.prompt  # type: ignore[union-attr]
                s.cache.extend(prompt[s.i_prompt : s.i_prompt + n])
                s.i_prompt += n
                s.n_prompt_done += n
            self.stats.n_tokens_max = max(self.stats.n_tokens_max, len(s.cache))
            if out < 0:
                continue
            if s.state is SlotState.PROCESSING_PROMPT:
                s.state, s.t_prompt_done = SlotState.GENERATING, now
                self.stats.n_prompt_tokens_total += s.n_prompt_done
                self.stats.n_prompt_tokens += s.n_prompt_done
                ms = (now - s.t_start) * 1e3
                self.stats.t_prompt_ms_total += ms
                self.stats.t_prompt_ms += ms
            try:
                self._sample(s, self.ctx.logits[out_row[out]])
            except Exception as e:
                self._fail(s, RequestError(f"sampling failed: {e}", 500, "server_error"))

    # -- per slot ---------------------------------------------------------------------------------
    def _sample(self, s: Slot, logits: torch.Tensor) -> None:
        task = s.task
        assert task is not None and s.sampler is not None and s.streamer is not None
        prob = None
        if task.params.n_probs > 0:
            lp = torch.log_softmax(logits.float(), -1)
        if s.bias is not None:
            logits = logits.float().index_put_(s.bias[:1], s.bias[1], accumulate=True)  # ctx.logits is ours
        tok = s.sampler.sample(logits)
        s.sampler.accept(tok)
        if task.params.n_probs > 0:
            top = torch.topk(lp, min(task.params.n_probs, lp.numel()))
            piece = self.vocab.token_to_piece
            prob = TokenProb(tok, piece(tok), float(lp[tok]),
                             [(int(i), piece(int(i)), float(v)) for v, i in zip(top.values, top.indices)])
        s.n_decoded += 1
        s.t_last = time.perf_counter()
        self._process_token(s, task, tok, prob)

    def _process_token(self, s: Slot, task: Task, tok: int, prob: TokenProb | None) -> None:
        """llama-server's process_token: stop strings, limits, EOG; then stream what is safe."""
        p = task.params
        s.sampled = tok
        s.generated.append(tok)
        piece = s.streamer.push(tok)  # type: ignore[union-attr]
        s.text += piece
        s.has_new_line = s.has_new_line or "\n" in piece
        is_eog = self.vocab.is_eog(tok)
        more, send = True, True
        tail = s.text[s.n_sent :]
        if p.stop:
            hits = [(tail.find(w), w) for w in p.stop if w in tail]
            if hits:
                pos, word = min(hits)
                s.text = s.text[: s.n_sent + pos]
                s.stop_type, s.stopping_word, more = "word", word, False
            elif not is_eog:
                send = all(find_partial_stop(tail, w) < 0 for w in p.stop)
        text = ""
        if send:
            text = s.text[s.n_sent :]
            s.n_sent = len(s.text)
        if prob is not None:
            s.probs.append(prob)
        if more and len(s.cache) + 1 >= s.n_ctx and not self.context_shift:
            s.truncated, s.stop_type, more = True, "limit", False
        if more and p.n_predict >= 0 and p.n_predict - s.n_decoded <= 0:
            s.stop_type, more = "limit", False
        if is_eog:
            s.stop_type, more = "eos", False
        if more and p.n_predict < 0 and len(s.cache) >= self.ctx.model.hparams.n_ctx_train:
            s.truncated, s.stop_type, more = True, "limit", False
        if p.stream:
            task.emit(Partial(task, s.id, tok, text, s.n_decoded, len(task.prompt), prob,
                              s.timings() if p.timings_per_token else None))
        if not more:
            self._finish(s)

    def _finish(self, s: Slot) -> None:
        task = s.task
        assert task is not None
        if s.stop_type != "word":  # what was held back as a possible stop string is text after all
            s.text += s.streamer.flush()  # type: ignore[union-attr]
        content = s.text[s.n_sent :] if task.params.stream else s.text
        task.emit(Final(task, s.id, content, list(s.generated), s.n_decoded, len(task.prompt),
                        len(s.cache), s.stop_type, s.stopping_word, s.truncated, s.has_new_line,
                        s.timings(), s.probs))
        st = self.stats
        ms = (s.t_last - s.t_prompt_done) * 1e3
        st.n_predicted_total += s.n_decoded
        st.n_predicted += s.n_decoded
        st.t_predicted_ms_total += ms
        st.t_predicted_ms += ms
        self._release(s, s.stop_type)

    def _release(self, s: Slot, reason: str) -> None:
        task = s.task
        self.releases.append(ReleaseRecord(s.id, task.id if task else -1, reason, self.iteration,
                                           task.cancel_iteration if task else -1))
        s.last_task, s.task = task, None
        s.state, s.sampler, s.bias = SlotState.IDLE, None, None
        s.t_last_used = time.perf_counter()
        self._notify("release", s)

    def _notify(self, kind: str, s: Slot) -> None:
        if self.listener is not None:
            try:
                self.listener(kind, s)
            except Exception:  # a logging hook must not break the engine
                pass

    def _fail(self, s: Slot, err: RequestError) -> None:
        """Error the slot's task, free its cells (llama-server clears a failed slot's KV)."""
        if not s.busy:
            return
        self.stats.n_errors += 1
        s.task.emit(Failed(s.task, err))  # type: ignore[union-attr]
        self.ctx.memory.seq_rm(s.id)
        s.cache.clear()
        self._release(s, "error")

    def _reap_cancelled(self) -> None:
        for s in self.slots:
            if s.busy and s.task.cancelled:  # type: ignore[union-attr]
                self.stats.n_cancelled += 1
                self.ctx.memory.seq_rm(s.id)
                s.cache.clear()
                self._release(s, "cancelled")
        if any(t.cancelled for t in self.queue):
            self.stats.n_cancelled += sum(t.cancelled for t in self.queue)
            self.queue = deque(t for t in self.queue if not t.cancelled)

    def _purge_idle(self) -> bool:
        """Unified KV: drop the largest idle slot's cached prompt to make room (llama-server)."""
        if not self.ctx.cparams.kv_unified:
            return False
        idle = [s for s in self.slots if not s.busy and s.cache]
        if not idle:
            return False
        s = max(idle, key=lambda s: len(s.cache))
        self.ctx.memory.seq_rm(s.id)
        s.cache.clear()
        return True

    # -- starting a task ----------------------------------------------------------------------------
    def _launch_queued(self) -> None:
        waiting: deque[Task] = deque()
        while self.queue:
            task = self.queue.popleft()
            slot = self._pick_slot(task)
            if slot is None:
                waiting.append(task)
            else:
                self._launch(slot, task)
        self.queue = waiting

    def _pick_slot(self, task: Task) -> Slot | None:
        if task.params.id_slot >= 0:
            s = self.slots[task.params.id_slot % len(self.slots)]
            return None if s.busy else s
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        if self.similarity > 0 and task.prompt:
            best, best_sim = None, self.similarity
            for s in idle:
                sim = common_prefix(s.cache, task.prompt) / len(task.prompt)
                if s.cache and sim > best_sim:
                    best, best_sim = s, sim
            if best is not None:
                return best
        return min(idle, key=lambda s: s.t_last_used)

    def _launch(self, s: Slot, task: Task) -> None:
        prompt, p = task.prompt, task.params
        if len(prompt) >= s.n_ctx:
            task.emit(Failed(task, RequestError(
                f"request ({len(prompt)} tokens) exceeds the available context size ({s.n_ctx} "
                "tokens), try increasing it", 400, "exceed_context_size_error",
                n_prompt_tokens=len(prompt), n_ctx=s.n_ctx)))
            return
        s.task, s.state = task, SlotState.PROCESSING_PROMPT
        s.t_start = time.perf_counter()
        s.generated, s.text, s.n_sent, s.probs = [], "", 0, []
        s.n_decoded, s.stop_type, s.stopping_word, s.truncated, s.has_new_line = 0, "none", "", False, False
        s.n_prompt_cache = s.n_prompt_done = 0
        if not prompt:  # llama-server answers an empty prompt at once
            s.t_prompt_done = s.t_last = s.t_start
            s.streamer = TokenStreamer(self.vocab)
            self._finish(s)
            return
        mem = self.ctx.memory
        n_past = common_prefix(s.cache, prompt) if p.cache_prompt else 0
        if p.cache_prompt and self.cache_reuse and (p.n_cache_reuse or self.cache_reuse):
            n_past = self._reuse_chunks(s, prompt, n_past, p.n_cache_reuse or self.cache_reuse)
        if n_past == len(prompt):
            n_past -= 1  # evaluate at least one token to get logits
        n_swa = self.ctx.model.hparams.n_swa
        if n_past > 0 and n_swa > 0 and mem.seq_pos_min(s.id) > max(0, n_past - n_swa):
            n_past = 0  # the sliding-window cache no longer holds what the suffix must see
        mem.seq_rm(s.id, n_past, -1)
        del s.cache[n_past:]
        s.n_prompt_cache = s.i_prompt = n_past
        s.n_prompt_done = 0
        s.sampler = Sampler(p.sampling)
        for t in prompt:
            s.sampler.accept(t)
        s.streamer = TokenStreamer(self.vocab)
        bias = list(p.logit_bias)
        if p.ignore_eos and self._eog is not None:
            bias += [(int(t), float("-inf")) for t in self._eog]
        s.bias = None
        if bias:
            s.bias = (torch.tensor([t for t, _ in bias], dtype=torch.long),
                      torch.tensor([b for _, b in bias], dtype=torch.float32))
        self._notify("launch", s)

    def _reuse_chunks(self, s: Slot, prompt: list[int], n_past: int, min_chunk: int) -> int:
        """--cache-reuse: move matching chunks of the old cache into place with a K-shift."""
        mem, cache = self.ctx.memory, s.cache
        head_c = head_p = n_past
        while head_c < len(cache) and head_p < len(prompt):
            n = 0
            while head_c + n < len(cache) and head_p + n < len(prompt) and cache[head_c + n] == prompt[head_p + n]:
                n += 1
            if n >= min_chunk:
                shift = head_p - head_c
                mem.seq_rm(s.id, head_p, head_c)
                mem.seq_add(s.id, head_c, head_c + n, shift)
                cache[head_p : head_p + n] = cache[head_c : head_c + n]
                n_past += n
                head_c += n
                head_p += n
            else:
                head_c += 1
        del cache[n_past:]
        return n_past

    def _shift(self, s: Slot) -> None:
        """Context shift: keep n_keep tokens, drop half of the rest, slide the remainder down."""
        task = s.task
        assert task is not None
        n_keep = (len(task.prompt) if task.params.n_keep < 0 else task.params.n_keep) + int(self.vocab.add_bos)
        n_keep = min(s.n_ctx - 4, n_keep)
        n_left = len(s.cache) - n_keep
        n_discard = task.params.n_discard or n_left // 2
        n_discard = max(0, min(n_discard, max(0, n_left - 1)))
        mem = self.ctx.memory
        mem.seq_rm(s.id, n_keep, n_keep + n_discard)
        mem.seq_add(s.id, n_keep + n_discard, len(s.cache), -n_discard)
        del s.cache[n_keep : n_keep + n_discard]
        s.truncated = True
