"""Embedding and rerank requests on the server's engine thread.

An embedding task needs no generation: its whole prompt is evaluated with embeddings on and its
result is sent at once. So it takes no part in the scheduler's continuous batching: it is a side
runner's (engine/serve/side_runner.py). Once per iteration, before the generation batch,
`EmbeddingRunner.run` packs the waiting tasks onto idle slots (a slot's sequence id is borrowed
for one decode) and runs them in one embedding decode (`embed_sequences`).

A borrowed slot's cached completion prompt leaves the KV cache, so it goes to host memory first
(`Slot.prompt_save`, with --cache-ram, when no other sequence holds it), as when a completion
takes the slot; llama-server drops it. The embedding prompts themselves are never cached, as in
llama-server (embedding and rerank tasks are stateless there): pooling needs every row's hidden
state, which K/V do not give back, and with non-causal attention each row depends on the whole
prompt, so a cached prefix would save nothing. A generation batch and an embedding batch never share
a decode, as in llama-server, where a batch is either one or the other. The prompt limits
llama-server applies to embedding inputs (`input_error`) live here too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ubatch.engine.context.context import Context
from ubatch.engine.errors import ContextError, EngineDown, EngineError, ErrorKind
from ubatch.engine.generation.embedding import RankHead, can_split, embed_sequences, fits_together, normalize, pool
from ubatch.engine.kv.memory import DecodeError, DecodeStatus
from ubatch.engine.serve.prompt_cache import purge_idle
from ubatch.engine.serve.side_runner import SideRunner
from ubatch.engine.serve.slot import Slot
from ubatch.engine.serve.stats import SchedulerStats
from ubatch.engine.serve.task import Job, Sink, context_error, decode_failure


def input_error(n_tokens: int, pooling: str, causal_attn: bool, n_ubatch: int, n_ctx_slot: int) -> EngineError | None:
    """What llama-server answers for a prompt a context with this pooling, attention and
    n_ubatch cannot embed (its messages; the caller's to fix, the client's or the operator's,
    not a server fault)."""
    if n_tokens == 0:
        return EngineError(ErrorKind.INVALID_REQUEST, "Input content cannot be empty")
    if can_split(pooling, causal_attn):
        return context_error(n_tokens, n_ctx_slot)
    if n_tokens > n_ubatch:
        return EngineError(
            ErrorKind.INVALID_REQUEST,
            f"input ({n_tokens} tokens) is too large to process. increase the physical batch size "
            f"(current batch size: {n_ubatch})",
        )
    if n_tokens > n_ctx_slot:
        return EngineError(
            ErrorKind.EXCEEDS_CONTEXT,
            f"input ({n_tokens} tokens) is larger than the max context size ({n_ctx_slot} tokens). skipping",
            n_prompt_tokens=n_tokens,
            n_ctx=n_ctx_slot,
        )
    return None


def fit_prompt(ctx: Context, tokens: list[int], truncate: bool, n_ctx: int) -> list[int]:
    """A prompt cut to what the context can embed (`truncate`), else refused in one line."""
    limit = n_ctx - 1 if can_split(ctx.pooling, ctx.cparams.causal_attn) else min(ctx.cparams.n_ubatch, n_ctx)
    if truncate and len(tokens) > limit:
        tokens = tokens[:limit]
    cp = ctx.cparams
    if (err := input_error(len(tokens), ctx.pooling, cp.causal_attn, cp.n_ubatch, n_ctx)) is not None:
        raise ContextError(err.message)
    return tokens


@dataclass(slots=True, eq=False)
class EmbdTask(Job):
    """One prompt to embed (or, with `rerank`, one query/document pair to score)."""

    id: int
    prompt: list[int]
    sink: Sink
    index: int = 0
    embd_normalize: int = 2
    rerank: bool = False
    cancelled: bool = False
    cancel_iteration: int = -1


@dataclass(slots=True)
class EmbdResult:
    """A task's answer: `embedding` holds one pooled row (n_tokens rows with pooling none);
    a rerank task has its `score` instead."""

    task: EmbdTask
    n_tokens: int
    embedding: list[list[float]] = field(default_factory=list)
    score: float = 0.0


class EmbeddingRunner(SideRunner[EmbdTask]):
    def __init__(self, ctx: Context, slots: list[Slot], stats: SchedulerStats) -> None:
        super().__init__(EmbdTask, ctx, slots, stats)
        self.head = RankHead.from_model(ctx.model) if ctx.pooling == "rank" else None

    def run(self) -> None:
        """Run as many waiting tasks as idle slots and one decode allow; the rest wait for the
        next iteration."""
        idle = sorted((s for s in self.slots if not s.busy), key=lambda s: (bool(s.cache), s.t_last_used))
        pack: list[EmbdTask] = []
        while self.pending and len(pack) < len(idle):
            if not fits_together(self.ctx, [len(t.prompt) for t in (*pack, self.pending[0])]):
                break
            pack.append(self.pending.popleft())
        while pack:
            try:
                self._embed(pack, idle[: len(pack)])
                return
            except DecodeError as e:
                if e.code is DecodeStatus.NO_KV_SLOT and purge_idle(
                    self.slots, self.ctx.memory, self.ctx.cparams.kv_unified
                ):
                    continue
                if e.code is DecodeStatus.NO_KV_SLOT and len(pack) > 1:  # no room for all of them: half now, half later
                    self.pending.extendleft(reversed(pack[len(pack) // 2 :]))
                    del pack[len(pack) // 2 :]
                    continue
                err = decode_failure(e)
            except EngineDown:  # a lost rank: the engine loop answers every request 503 and stops
                raise
            except Exception as e:  # a bug fails these requests, never the engine thread
                err = decode_failure(e)
            for t in pack:
                t.fail(err)
            return

    def _embed(self, pack: list[EmbdTask], slots: list[Slot]) -> None:
        """One embedding decode of `pack`, each task on a slot's sequence id (borrowed: the
        slot's cached prompt goes to host memory if it can, then its cells are freed)."""
        for s in slots:
            s.prompt_save()
            s.cache.clear()  # embed_sequences frees the cells
        t0 = time.perf_counter()
        hidden = embed_sequences(self.ctx, [(s.id, t.prompt) for s, t in zip(slots, pack)])
        self.stats.prompt_done(sum(len(t.prompt) for t in pack), (time.perf_counter() - t0) * 1e3)
        for t, rows in zip(pack, hidden):
            t.emit(self.result(t, rows))

    def result(self, t: EmbdTask, rows: torch.Tensor) -> EmbdResult:
        """Pool a task's hidden states; normalise unless the pooling is none (llama-server)."""
        ctx = self.ctx
        v = pool(rows, ctx.pooling, ctx.cparams.causal_attn, self.head)
        if t.rerank:
            return EmbdResult(t, len(t.prompt), score=float(v[0]))
        if ctx.pooling == "none":
            return EmbdResult(t, len(t.prompt), v.tolist())
        return EmbdResult(t, len(t.prompt), [normalize(v, t.embd_normalize).tolist()])
