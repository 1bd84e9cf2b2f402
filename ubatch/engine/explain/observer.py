"""What `ubatch explain` keeps while a request runs: every decode call and its ubatches, as the
context reports them through `Context.observers` (no second code path decides anything).

A `Recorder` is one observer. For each ubatch it keeps the rows (sequence ids, positions, kind:
prompt, generated or drafted), the graph shape's n_kv per cache with the cells in use behind it,
whether the graph shape was reused, and for one small ubatch the mask as reasons
(engine/explain/mask.py), taken while the cells are exactly those the mask was built from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ubatch.engine.batch import Batch, UBatch
from ubatch.engine.context.context import Context, UBatchRecord
from ubatch.engine.explain.mask import MaskGrid, mask_grid

MASK_MAX_ROWS = 16  # a mask grid is drawn for a ubatch of at most this many rows


@dataclass(slots=True)
class CacheUse:
    """One cache as one ubatch saw it: n_kv of the graph and the cells behind it."""

    cache: str
    n_kv: int
    used: int  # cells holding a position in the ubatch's streams
    used_max_p1: int  # one past the last used cell: what n_kv is rounded up from
    size: int  # cells per stream

    @property
    def pad(self) -> int:
        """Cells attended over beyond the last used one: the rounding to the 256 quantum."""
        return self.n_kv - self.used_max_p1


@dataclass(slots=True)
class UBatchView:
    call: int  # index of the decode call
    index: int  # index of the ubatch in the whole run
    n_tokens: int
    n_outputs: int
    n_seqs: int  # split_equal's sequence groups
    seq_ids: list[int]
    row_seq: list[list[int]]  # the sequence ids of each row, in ubatch order
    row_pos: list[int]
    row_kind: str  # one character per row: p prompt, g generated, d drafted
    batch_idx: list[int]  # each row's index in its decode call's batch
    kv: list[CacheUse]
    reused: bool
    ms: float
    # per sequence, the LoRA adapters (id, scale) its rows applied; absent: the base model
    loras: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


@dataclass(slots=True)
class CallView:
    """One `Context.decode`: the batch as submitted, then the ubatches it was split into."""

    index: int
    batch: Batch
    ubatches: list[UBatchView] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return self.batch.n_tokens

    @property
    def n_outputs(self) -> int:
        return sum(self.batch.logits)


class Recorder:
    """The observer: attach with `Recorder.attach(ctx)`, run, read `calls` and `mask`."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.calls: list[CallView] = []
        self.mask: list[MaskGrid] = []  # per cache, for the chosen small ubatch
        self.mask_ubatch = -1  # index of that ubatch
        self._mask_rank = -1
        self._last: Batch | None = None

    @classmethod
    def attach(cls, ctx: Context) -> Recorder:
        r = cls(ctx)
        ctx.observers.append(r)
        return r

    def detach(self) -> None:
        if self in self.ctx.observers:
            self.ctx.observers.remove(self)

    @property
    def ubatches(self) -> list[UBatchView]:
        return [u for c in self.calls for u in c.ubatches]

    def __call__(self, batch: Batch, ub: UBatch, rec: UBatchRecord) -> None:
        if batch is not self._last:  # the first ubatch of a new decode call
            self._last = batch
            kept = Batch(list(batch.token), list(batch.pos), [list(s) for s in batch.seq_id], list(batch.logits))
            kept.kind = [batch.kind_of(i) for i in range(batch.n_tokens)]
            self.calls.append(CallView(len(self.calls), kept))
        call = self.calls[-1]
        kinds = "".join(batch.kind_of(int(i)) for i in ub.batch_idx)
        caches = self.ctx.memory.caches
        kv = []
        for c, n_kv in zip(caches, rec.n_kv):
            streams = c.ubatch_streams(ub)
            cells = [c.streams[s] for s in streams]
            kv.append(
                CacheUse(c.name or "KV", n_kv, sum(x.used for x in cells), max(x.used_max_p1 for x in cells), c.size)
            )
        view = UBatchView(
            call.index,
            sum(len(x.ubatches) for x in self.calls),
            rec.n_tokens,
            rec.n_outputs,
            rec.n_seqs,
            list(rec.seq_ids),
            [list(s) for s in ub.seq_id],
            [int(p) for p in ub.pos],
            kinds,
            [int(i) for i in ub.batch_idx],
            kv,
            rec.reused,
            rec.ms,
            {k: list(v) for k, v in rec.loras.items()},
        )
        call.ubatches.append(view)
        self._maybe_mask(ub, view, kinds)

    def _maybe_mask(self, ub: UBatch, view: UBatchView, kinds: str) -> None:
        """Keep the mask of the most telling small ubatch: several sequences, then several rows."""
        if view.n_tokens > MASK_MAX_ROWS:
            return
        rank = 2 * (len(view.seq_ids) > 1) + (view.n_tokens > 1)
        if rank <= self._mask_rank:
            return
        self._mask_rank, self.mask_ubatch = rank, view.index
        causal = self.ctx.cparams.causal_attn
        self.mask = [
            mask_grid(c, ub, kinds, n_kv, causal) for c, n_kv in zip(self.ctx.memory.caches, (k.n_kv for k in view.kv))
        ]
