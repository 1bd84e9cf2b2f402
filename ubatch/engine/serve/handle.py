"""What the HTTP side may know of the engine without reaching into it: the vocabulary, the
model's metadata, the per-slot context and the sizes the routes check requests against.

Routes run on other threads than the engine; everything here is fixed once the model is loaded
(read at start-up, before the first request), so reading it needs no lock and no snapshot. What
moves (slots, cells, counters) comes from `EngineLoop.snapshot` (engine/serve/snapshot.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ubatch.engine.context.report import MemoryPlan, memory_plan
from ubatch.engine.gguf.metadata import Metadata
from ubatch.engine.model.hparams import HParams
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.vocab.vocab import Vocab


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The loaded model as /models and /props describe it."""

    path: Path
    metadata: Metadata  # the GGUF's key-value metadata
    hparams: HParams
    n_params: int
    size_bytes: int


@dataclass(frozen=True, slots=True)
class EngineHandle:
    vocab: Vocab
    model: ModelInfo
    n_ctx_slot: int  # what one slot's sequence may hold
    n_slots: int
    cache_reuse: int  # --cache-reuse as the context allows it (0: off)
    n_batch: int
    n_ubatch: int
    causal_attn: bool
    pooling: str  # none|mean|cls|last|rank
    plan: MemoryPlan  # the memory plan, as allocated

    @classmethod
    def of(cls, sch: Scheduler) -> EngineHandle:
        """Read once, before the engine thread takes any request."""
        ctx, m = sch.ctx, sch.ctx.model
        cp = ctx.cparams
        info = ModelInfo(m.path, m.gguf.metadata, m.hparams, m.n_params, m.size_bytes)
        return cls(
            sch.vocab,
            info,
            sch.n_ctx_slot,
            len(sch.slots),
            sch.cache_reuse,
            cp.n_batch,
            cp.n_ubatch,
            cp.causal_attn,
            ctx.pooling,
            memory_plan(ctx),
        )
