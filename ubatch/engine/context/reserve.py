"""Size a context before allocating it: the worst-case graphs' workspace, the KV cache, the outputs.

llama.cpp's sched_reserve plans the largest graphs a context will run and allocates the compute
buffer once. Planning needs only shapes and dtypes, so it runs against a sizes-only KV memory
(meta tensors, no cells): `ubatch info` and `--fit` plan any configuration without allocating
it, and a context checks that its buffers fit the machine before it makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ubatch.engine.errors import ContextError
from ubatch.engine.graph.forward import GraphShape, build_forward
from ubatch.engine.kv.cache import round_up
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.model.model import Model
from ubatch.engine.params import CParams
from ubatch.kernels.ops import Ops

RESERVE_ALIGN = 64 << 10


@dataclass(slots=True)
class Reservation:
    """The workspace sized up front for the largest graphs this context may run."""

    pp: GraphShape
    tg: GraphShape
    pp_bytes: int
    tg_bytes: int
    n_nodes: tuple[int, int]
    peak: list[tuple[str, tuple[int, ...], int]]  # largest live tensors of the larger graph
    # a mixture of experts: the router's and the experts' tensors of one layer of the prompt graph
    moe: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        # best-fit placement is not monotone in the shape: a smaller ubatch can fragment a few
        # KiB worse than the worst-case plan, so the buffer is rounded up to 64 KiB
        return -(-max(self.pp_bytes, self.tg_bytes) // RESERVE_ALIGN) * RESERVE_ALIGN


def reserve(model: Model, memory: KVMemory, cp: CParams, ops: Ops) -> Reservation:
    """Plan the worst-case graphs as llama.cpp's sched_reserve: a prompt ubatch of
    min(n_ctx, n_ubatch) tokens over n_seq_max sequences, and a one-token-per-sequence
    generation ubatch, both against full caches. Only shapes are read: `memory` may be sizes-only."""
    n_seqs = cp.n_seq_max
    n_tokens = round_up(min(cp.n_ctx, cp.n_ubatch), n_seqs)
    groups = tuple(1 if c.n_stream == 1 else n_seqs for c in memory.caches)
    n_kv = tuple(c.size for c in memory.caches)
    m = len(model.adapters)  # the worst case: every row applies every adapter
    pp = GraphShape(n_tokens, min(n_tokens, cp.n_outputs_max), groups, n_kv, lora_slots=m, n_adapters=m)
    tg = GraphShape(n_seqs, min(n_seqs, cp.n_outputs_max), groups, n_kv, lora_slots=m, n_adapters=m)
    gp = build_forward(model, memory, pp, ops)
    gt = build_forward(model, memory, tg, ops)
    big = gp if gp.size >= gt.size else gt
    moe = gp.describe_nodes("ffn_moe_", "-0") if model.hparams.moe else []
    return Reservation(pp, tg, gp.size, gt.size, (len(gp.nodes), len(gt.nodes)), big.describe_peak(), moe)


@dataclass(slots=True)
class ContextSizes:
    """Every buffer a context allocates beyond the memory-mapped weights, in bytes."""

    kv: int
    cells: int  # the cells' host bookkeeping (positions, sequence sets), and the copy a decode checks against
    compute: int
    output: int
    backend: int  # weight copies the backend makes (dense f32 for torch)

    @property
    def total(self) -> int:
        return self.kv + self.cells + self.compute + self.output + self.backend


def plan_sizes(model: Model, cp: CParams, ops: Ops) -> tuple[KVMemory, Reservation, ContextSizes]:
    """A sizes-only KV memory, its reservation and what the context would allocate."""
    shadow = KVMemory.build(model.hparams, cp, sizes_only=True)
    r = reserve(model, shadow, cp, ops)
    infos = [c.info() for c in shadow.caches]
    kv = sum(i.k_bytes + i.v_bytes for i in infos)
    cells = 2 * sum(i.size * i.n_stream * (16 + cp.n_seq_max) for i in infos)
    output = model.hparams.n_vocab * cp.n_seq_max * 4
    return shadow, r, ContextSizes(kv, cells, r.bytes, output, ops.held_bytes())


def available_bytes(device: torch.device) -> int | None:
    """What the machine can still give: MemAvailable (host) or the device's free memory; None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def human(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:,.1f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def check_fits(sizes: ContextSizes, cp: CParams, device: torch.device, available: int | None = None) -> None:
    """Refuse, in one line and before anything is allocated, a context the machine cannot hold."""
    free = available_bytes(device) if available is None else available
    if free is None or sizes.total <= free:
        return
    parts = [
        ("KV cache", sizes.kv),
        ("compute buffer", sizes.compute),
        ("output buffer", sizes.output),
        ("KV cells", sizes.cells),
        ("backend weights", sizes.backend),
    ]
    detail = " + ".join(f"{name} {human(n)}" for name, n in parts if n)
    raise ContextError(
        f"the context needs {human(sizes.total)} ({detail}) but {human(free)} is available; "
        f"lower -c (n_ctx = {cp.n_ctx}), -ub ({cp.n_ubatch}), -np ({cp.n_seq_max}) or use -ctk/-ctv q8_0 "
        "(see `ubatch info --fit`)"
    )
