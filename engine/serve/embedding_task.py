"""Embedding and rerank requests on the server's engine thread.

An embedding task needs no generation: its whole prompt is evaluated with embeddings on and its
result is sent at once. So it does not take part in the scheduler's continuous batching; once
per iteration, before the generation batch, `EmbeddingRunner.step` packs the waiting tasks onto
idle slots (a slot's sequence id is borrowed for one decode; its cached prompt is dropped, as
llama-server reuses the slot) and runs them in one embedding decode (`embed_sequences`). A
generation batch and an embedding batch never share a decode, as in llama-server, where a batch
is either one or the other. The prompt limits llama-server applies to embedding inputs
(`input_error`) live here too, with the server's other request errors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ubatch.engine.errors import ContextError
from ubatch.engine.generation.embedding import RankHead, can_split, embed_sequences, fits_together, normalize, pool
from ubatch.engine.kv.memory import DecodeError
from ubatch.engine.serve.task import Failed, RequestError, context_error

if TYPE_CHECKING:
    from ubatch.engine.context.context import Context
    from ubatch.engine.serve.scheduler import Scheduler


def input_error(n_tokens: int, ctx: Context, n_ctx_slot: int) -> RequestError | None:
    """What llama-server answers for a prompt this context cannot embed (its messages; a 400
    here, since the fix is the client's or the operator's, not a server fault)."""
    if n_tokens == 0:
        return RequestError("Input content cannot be empty")
    if can_split(ctx.pooling, ctx.cparams.causal_attn):
        return context_error(n_tokens, n_ctx_slot)
    n_ubatch = ctx.cparams.n_ubatch
    if n_tokens > n_ubatch:
        return RequestError(
            f"input ({n_tokens} tokens) is too large to process. increase the physical batch size "
            f"(current batch size: {n_ubatch})"
        )
    if n_tokens > n_ctx_slot:
        return RequestError(
            f"input ({n_tokens} tokens) is larger than the max context size ({n_ctx_slot} tokens). skipping",
            400,
            "exceed_context_size_error",
            n_prompt_tokens=n_tokens,
            n_ctx=n_ctx_slot,
        )
    return None


def fit_prompt(ctx: Context, tokens: list[int], truncate: bool, n_ctx: int) -> list[int]:
    """A prompt cut to what the context can embed (`truncate`), else refused in one line."""
    limit = n_ctx - 1 if can_split(ctx.pooling, ctx.cparams.causal_attn) else min(ctx.cparams.n_ubatch, n_ctx)
    if truncate and len(tokens) > limit:
        tokens = tokens[:limit]
    if (err := input_error(len(tokens), ctx, n_ctx)) is not None:
        raise ContextError(err.message)
    return tokens


@dataclass(slots=True, eq=False)
class EmbdTask:
    """One prompt to embed (or, with `rerank`, one query/document pair to score)."""

    id: int
    prompt: list[int]
    sink: Callable[[Any], None]
    index: int = 0
    embd_normalize: int = 2
    rerank: bool = False
    cancelled: bool = False
    cancel_iteration: int = -1

    def emit(self, event: Any) -> None:
        if not self.cancelled:
            self.sink(event)


@dataclass(slots=True)
class EmbdResult:
    """A task's answer: `embedding` holds one pooled row (n_tokens rows with pooling none);
    a rerank task has its `score` instead."""

    task: EmbdTask
    n_tokens: int
    embedding: list[list[float]] = field(default_factory=list)
    score: float = 0.0


class EmbeddingRunner:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.pending: deque[EmbdTask] = deque()
        self.head = RankHead.from_model(ctx.model) if ctx.pooling == "rank" else None

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def fail_pending(self, err: RequestError) -> None:
        while self.pending:
            t = self.pending.popleft()
            t.emit(Failed(t, err))  # type: ignore[arg-type]

    def step(self, sch: Scheduler) -> None:
        """Take the embedding tasks out of the scheduler's queue, then run as many of them as
        idle slots and one decode allow; the rest wait for the next iteration."""
        rest = [t for t in sch.queue if not isinstance(t, EmbdTask)]
        self.pending.extend(t for t in sch.queue if isinstance(t, EmbdTask))
        if len(rest) != len(sch.queue):
            sch.queue.clear()
            sch.queue.extend(rest)
        self.pending = deque(t for t in self.pending if not t.cancelled)
        idle = sorted((s for s in sch.slots if not s.busy), key=lambda s: (bool(s.cache), s.t_last_used))
        pack: list[EmbdTask] = []
        while self.pending and len(pack) < len(idle):
            if not fits_together(self.ctx, [len(t.prompt) for t in (*pack, self.pending[0])]):
                break
            pack.append(self.pending.popleft())
        while pack:
            try:
                self._run(sch, pack, [s.id for s in idle])
                return
            except DecodeError as e:
                if e.code == 1 and sch._purge_idle():
                    continue
                if e.code == 1 and len(pack) > 1:  # no room for all of them: half now, half later
                    self.pending.extendleft(reversed(pack[len(pack) // 2 :]))
                    del pack[len(pack) // 2 :]
                    continue
                msg = "Context size has been exceeded." if e.code == 1 else f"Invalid input batch. ({e})"
                err = RequestError(msg, 500, "server_error")
            except Exception as e:  # a bug fails these requests, never the engine thread
                err = RequestError(f"Compute error. ({e})", 500, "server_error")
            for t in pack:
                t.emit(Failed(t, err))  # type: ignore[arg-type]
            return

    def _run(self, sch: Scheduler, pack: list[EmbdTask], seq_ids: list[int]) -> None:
        for s in sch.slots:
            if s.id in seq_ids[: len(pack)]:
                s.cache.clear()  # embed_sequences frees the cells
        t0 = time.perf_counter()
        hidden = embed_sequences(self.ctx, [(s, t.prompt) for s, t in zip(seq_ids, pack)])
        sch.stats.prompt_done(sum(len(t.prompt) for t in pack), (time.perf_counter() - t0) * 1e3)
        for t, rows in zip(pack, hidden):
            t.emit(self.result(t, rows))

    def result(self, t: EmbdTask, rows: Any) -> EmbdResult:
        """Pool a task's hidden states; normalise unless the pooling is none (llama-server)."""
        ctx = self.ctx
        v = pool(rows, ctx.pooling, ctx.cparams.causal_attn, self.head)
        if t.rerank:
            return EmbdResult(t, len(t.prompt), score=float(v[0]))
        if ctx.pooling == "none":
            return EmbdResult(t, len(t.prompt), v.tolist())
        return EmbdResult(t, len(t.prompt), [normalize(v, t.embd_normalize).tolist()])
