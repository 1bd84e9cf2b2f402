"""What a context allocated and why, as data (the MemoryPlan). Nothing here prints: cli.memory_view
renders the one plan as llama.cpp's startup lines, Rich tables and JSON, so every view agrees."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ubatch.engine.context.context import Context, make_backend
from ubatch.engine.context.reserve import Reservation, plan_sizes
from ubatch.engine.errors import ContextError
from ubatch.engine.kv.cache import KVCacheInfo
from ubatch.engine.model.lora import AdapterInfo, adapter_infos
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams, CParams, derive
from ubatch.engine.units import mib
from ubatch.kernels.ops import Ops
from ubatch.kernels.quant.dequant import type_name


@dataclass(slots=True)
class TPPlan:
    """Tensor parallelism in the plan: how the model is cut and what the ranks exchange. The
    MemoryPlan it belongs to is one rank's (every rank's buffers have the same shapes)."""

    world: int
    n_head: tuple[int, int]  # (the model's, one rank's)
    n_head_kv: tuple[int, int]  # one rank's > model's / world: KV heads replicated
    n_ff: tuple[int, int]
    n_vocab: tuple[int, int]  # one rank's: its slice of the embedding and output rows
    whole_bytes: int  # the model's weights in one process
    all_reduces: int  # per forward pass: one per layer after attention and one after the FFN, one for the embeddings
    all_reduce_bytes: int  # per token and forward pass: the rows summed over the ranks
    gather_bytes: int  # rank 0's buffer for the ranks' logits slices at n_outputs_max rows

    @property
    def kv_replicated(self) -> bool:
        return self.n_head_kv[1] * self.world > self.n_head_kv[0]


def tp_plan(m: Model, cp: CParams) -> TPPlan | None:
    """The tensor-parallel part of a plan (None for a whole model)."""
    if m.shard is None or m.whole is None:
        return None
    w, hp, whole = m.shard.world, m.hparams, m.whole
    n_reduce = 2 * hp.n_layer + 1
    return TPPlan(
        world=w,
        n_head=(whole.n_head, hp.n_head),
        n_head_kv=(whole.n_head_kv, hp.n_head_kv),
        n_ff=(whole.n_ff, hp.n_ff),
        n_vocab=(whole.n_vocab, m.shard.vocab_rows),
        whole_bytes=sum(t.n_bytes for t in m.gguf.tensors.values()),
        all_reduces=n_reduce,
        all_reduce_bytes=n_reduce * hp.n_embd * 4,
        gather_bytes=w * m.shard.vocab_rows * cp.n_outputs_max * 4,
    )


@dataclass(slots=True)
class MoePlan:
    """A mixture of experts in the plan: the weights a token reads against those the file holds
    (every tensor but the experts, and n_expert_used of n_expert of those), and the router's and
    experts' tensors in the compute buffer (one layer of the prompt graph)."""

    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    expert_bytes: int  # the 3-D expert tensors as stored (memory-mapped)
    active_bytes: int  # weights one token's forward reads
    active_params: int
    compute: list[tuple[str, tuple[int, ...], int]]


def moe_plan(m: Model, r: Reservation) -> MoePlan | None:
    moe = m.hparams.moe
    if moe is None:
        return None
    exps = [w for L in m.layers for f, w in L.mats.items() if f.endswith("_exps")]
    eb, ep = sum(w.nbytes for w in exps), sum(math.prod(w.shape) for w in exps)
    return MoePlan(
        n_expert=moe.n_expert,
        n_expert_used=moe.n_expert_used,
        n_ff_exp=moe.n_ff_exp,
        expert_bytes=eb,
        active_bytes=m.active_bytes,
        active_params=m.n_params - ep + round(ep * moe.n_expert_used / moe.n_expert),
        compute=r.moe,
    )


@dataclass(slots=True)
class MlaPlan:
    """Multi-head latent attention's KV cache: one compressed row per token and layer (K only),
    against the per-head K and V the same attention would keep without the compression."""

    kv_lora_rank: int
    n_rot: int
    n_head: int
    n_embd_head_k: int  # one head's q·k width (no-RoPE + RoPE dims)
    n_embd_head_v: int

    @property
    def cell_values(self) -> int:
        """Values one cell holds per layer: the latent and the RoPE'd key part."""
        return self.kv_lora_rank + self.n_rot

    @property
    def mha_values(self) -> int:
        """Values per cell and layer of per-head K and V (llama.cpp's non-MLA deepseek2 cache)."""
        return self.n_head * (self.n_embd_head_k + self.n_embd_head_v)


def mla_plan(m: Model) -> MlaPlan | None:
    hp = m.hparams
    if hp.mla is None:
        return None
    return MlaPlan(hp.mla.kv_lora_rank, hp.n_rot, hp.n_head, hp.mla.n_embd_head_k, hp.mla.n_embd_head_v)


@dataclass(slots=True)
class MemoryPlan:
    model_file: str
    arch: str
    n_params: int
    model_bytes: int  # the GGUF tensors as stored (memory-mapped)
    backend: str  # the op backend the context computes with (kernels.backends)
    backend_bytes: int  # weight memory the backend holds beyond the file (dense copies, repacks)
    kernels: dict[str, str]  # tensor type -> how the backend multiplies with it
    n_ctx: int
    n_ctx_seq: int
    n_ctx_train: int  # n_ctx_seq below it leaves part of the model's trained context unused
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_outputs_max: int
    kv_unified: bool
    kv: list[KVCacheInfo]
    compute_bytes: int  # the workspace: max of the pp and tg graphs' reservations
    pp_bytes: int
    tg_bytes: int
    output_bytes: int  # logits rows: n_vocab x max(n_outputs, n_seq_max) x 4, + n_embd per embedding row
    worst_case: tuple[int, int, int]  # (n_tokens, n_seqs, n_outputs) of the prompt reservation
    graph_nodes: tuple[int, int]
    peak: list[tuple[str, tuple[int, ...], int]]
    warnings: list[str] = field(default_factory=list)
    device: str = "cpu"  # where the weights, the KV cache and the compute buffer live (torch's name)
    tp: TPPlan | None = None  # tensor parallelism: the plan above is one rank's
    moe: MoePlan | None = None  # a mixture of experts: total against active weights, its tensors
    mla: MlaPlan | None = None  # latent attention: the compressed KV row against per-head K and V
    loras: list[AdapterInfo] = field(default_factory=list)  # LoRA adapters loaded for the model
    dispatch: tuple[str, ...] = ()  # which kernel builds the backend chose by measurement, and why

    @property
    def lora_bytes(self) -> int:
        return sum(a.nbytes for a in self.loras)

    @property
    def kv_bytes(self) -> int:
        return sum(c.k_bytes + c.v_bytes for c in self.kv)

    @property
    def context_bytes(self) -> int:
        return self.kv_bytes + self.output_bytes

    @property
    def total_bytes(self) -> int:
        gather = self.tp.gather_bytes if self.tp is not None else 0
        weights = self.model_bytes + self.backend_bytes + self.lora_bytes
        return weights + self.context_bytes + self.compute_bytes + gather

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.model_bytes / max(self.n_params, 1)


def memory_plan(ctx: Context) -> MemoryPlan:
    """The plan of a context that exists: read from the objects that hold the memory."""
    return _plan(
        ctx.model,
        ctx.cparams,
        ctx.ops,
        [c.info() for c in ctx.memory.caches],
        ctx.reservation,
        ctx.output_rows,
        ctx.embd_bytes,
    )


def plan_for(model: Model, params: ContextParams) -> MemoryPlan:
    """The memory plan of a configuration without allocating it: the same numbers a Context of
    these parameters reports (tests/test_memory_plan.py), from shapes alone (engine/context/reserve.py)."""
    cp = derive(params, model.hparams)
    ops = make_backend(params.backend, cp.n_threads)
    ops.prepare_weights(model.matrices())
    shadow, r, _ = plan_sizes(model, cp, ops)
    return _plan(model, cp, ops, [c.info() for c in shadow.caches], r, cp.n_seq_max)


def _plan(
    m: Model, cp: CParams, ops: Ops, kv: list[KVCacheInfo], r: Reservation, output_rows: int, embd_bytes: int = 0
) -> MemoryPlan:
    types = sorted({w.ggml_type for w in m.matrices()})
    kernels = {type_name(t): ops.kernel_path(t) for t in types}
    return MemoryPlan(
        model_file=str(m.path),
        arch=m.hparams.arch,
        n_params=m.n_params,
        model_bytes=m.size_bytes,
        backend=ops.name,
        backend_bytes=ops.held_bytes(),
        kernels=kernels,
        n_ctx=cp.n_ctx,
        n_ctx_seq=cp.n_ctx_seq,
        n_ctx_train=m.hparams.n_ctx_train,
        n_batch=cp.n_batch,
        n_ubatch=cp.n_ubatch,
        n_seq_max=cp.n_seq_max,
        n_outputs_max=cp.n_outputs_max,
        kv_unified=cp.kv_unified,
        kv=kv,
        compute_bytes=r.bytes,
        pp_bytes=r.pp_bytes,
        tg_bytes=r.tg_bytes,
        output_bytes=m.hparams.n_vocab * output_rows * 4 + embd_bytes,
        worst_case=(r.pp.n_tokens, cp.n_seq_max, r.tg.n_outputs),
        graph_nodes=r.n_nodes,
        peak=r.peak,
        warnings=[*cp.warnings, *ops.notices],
        device=str(m.device),
        tp=tp_plan(m, cp),
        moe=moe_plan(m, r),
        mla=mla_plan(m),
        loras=adapter_infos(m.adapters),
        dispatch=ops.dispatch,
    )


def fit(model: Model, params: ContextParams, budget: int) -> tuple[ContextParams, MemoryPlan]:
    """The largest context (up to the training context) whose whole plan fits `budget` bytes.

    -ub is part of the fit: a smaller ubatch shrinks the compute buffer, which can buy context;
    among equal contexts the larger -ub wins. -np is lowered only when nothing fits otherwise.
    """
    n_ctx_train = model.hparams.n_ctx_train
    best: tuple[int, int, ContextParams, MemoryPlan] | None = None
    smallest: MemoryPlan | None = None
    for np_ in range(max(1, params.n_seq_max), 0, -1):
        step = 256 * (1 if params.kv_unified else np_)
        ub = params.n_ubatch or params.n_batch
        ubs = [u for u in (ub, 256, 128, 64) if u <= ub]
        for u in dict.fromkeys(ubs):
            base = replace(params, n_seq_max=np_, n_ubatch=u)
            lo_plan = plan_for(model, replace(base, n_ctx=step))
            if smallest is None or lo_plan.total_bytes < smallest.total_bytes:
                smallest = lo_plan
            if lo_plan.total_bytes > budget:
                continue
            lo, hi = 1, max(1, n_ctx_train * (1 if params.kv_unified else np_) // step)
            found = (1, lo_plan)
            while lo <= hi:  # memory grows with n_ctx: binary search on multiples of `step`
                mid = (lo + hi) // 2
                p = plan_for(model, replace(base, n_ctx=mid * step))
                if p.total_bytes <= budget:
                    found, lo = (mid, p), mid + 1
                else:
                    hi = mid - 1
            n_ctx = found[0] * step
            if best is None or n_ctx > best[0] or (n_ctx == best[0] and u > best[1]):
                best = (n_ctx, u, replace(base, n_ctx=n_ctx), found[1])
        if best is not None:
            derive(best[2], model.hparams)
            return best[2], best[3]
    assert smallest is not None
    raise ContextError(
        f"no plan fits {mib(budget):.1f} MiB: the smallest (-c {smallest.n_ctx} -ub {smallest.n_ubatch} "
        f"-np {smallest.n_seq_max}) needs {mib(smallest.total_bytes):.1f} MiB "
        f"(model {mib(smallest.model_bytes):.1f} + backend weights {mib(smallest.backend_bytes):.1f} + "
        f"KV/output {mib(smallest.context_bytes):.1f} + compute {mib(smallest.compute_bytes):.1f})"
    )
