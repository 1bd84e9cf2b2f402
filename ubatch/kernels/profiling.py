"""A timing proxy around any op backend, for `ubatch bench --profile`.

It lives with the kernels because it only knows the `Ops` interface: it wraps a backend, passes
every call through, and adds up wall-clock time per op category. The bench turns those sums into
its "where the time goes" table; nothing in a normal run pays for the timers. A timed node is a
Python closure, so a profiled graph runs every node as its own call (it keeps `Ops.fuse`'s
default: the backend cannot fuse runs of C calls into one): the per-call overhead a normal run
no longer pays shows up in each op's category.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from ubatch.kernels.cpu.ops import CpuOps
from ubatch.kernels.cpu.peaks import MachinePeaks, measure_peaks
from ubatch.kernels.ops import (
    OPS,
    AttentionArgs,
    GraphRunner,
    KVTensor,
    LinearArgs,
    MoeTopKArgs,
    MoeWeightsArgs,
    MulMatIdArgs,
    NodeArgs,
    Ops,
    ScratchSpec,
    Step,
    op_decl,
)
from ubatch.kernels.quant.weight import QWeight

R = TypeVar("R")

# op method -> category, as each op declares it (kernels/ops.py); `linear` with the output matrix
# is split out as "lm_head"
OP_CATEGORY = {d.name: d.category for d in OPS.values()} | {"rope_cache": "rope"}
CATEGORIES = (
    "matmul",
    "lm_head",
    "attention",
    "norm",
    "rope",
    "elementwise",
    "kv_write",
    "rows",
    "collective",
    "overhead",
)
CATEGORY_TITLES = {
    "matmul": "matmul (layers)",
    "lm_head": "matmul (output)",
    "attention": "attention",
    "norm": "norms",
    "rope": "rope",
    "elementwise": "act/add/scale",
    "kv_write": "KV writes",
    "rows": "embd/rows",
    "collective": "all-reduce/gather",
    "overhead": "Python/graph",
}
LM_HEAD_NAMES = frozenset({"output.weight", "token_embd.weight"})


def _linear_category(w: QWeight) -> str:
    return "lm_head" if w.name in LM_HEAD_NAMES else "matmul"


def _kv_bytes_per_cell(kv: KVTensor) -> int:
    return kv.data[0].numel() * kv.data.element_size() if kv.data.shape[0] else 0


def work_of(a: NodeArgs[Tensor]) -> tuple[float, float]:
    """(flops, bytes of weights or KV read) of one call of an op, for the fraction-of-peak table:
    a matrix product 2 m n k and its weight's bytes; a mixture of experts' chosen rows and the
    distinct experts' bytes; attention 4 x rows x heads x head_dim x n_kv and the K and V cells
    it reads. Other ops count nothing (their time is not compared with a peak)."""
    if isinstance(a, LinearArgs):
        m = a.x.numel() // a.x.shape[-1]
        return 2.0 * m * a.w.shape[0] * a.w.shape[-1], float(a.w.nbytes)
    if isinstance(a, MulMatIdArgs):
        n_expert, rows, cols = a.w.shape[0], a.w.shape[-2], a.w.shape[-1]
        chosen = int(torch.unique(a.ids).numel())
        return 2.0 * a.ids.numel() * rows * cols, float(a.w.nbytes) * min(chosen, n_expert) / n_expert
    if isinstance(a, AttentionArgs):
        g, t, h, d = a.q.shape
        seen = float(a.visible.float().mean()) if a.visible is not None and a.visible.numel() else 1.0
        cells = g * a.n_kv * seen  # the 256-cell chunks some query sees; a causal tile's masked half still counts
        return 4.0 * t * h * d * cells, cells * (_kv_bytes_per_cell(a.k) + _kv_bytes_per_cell(a.v))
    return 0.0, 0.0


class ProfilingOps(Ops):
    """A backend with a wall-clock timer around every op (CPU ops are synchronous, so the time is
    the op's own). Only calls made while `active` are counted. Weights, scratch plans and the
    backend's capabilities are the inner backend's."""

    def __init__(self, inner: Ops) -> None:
        self.inner = inner
        self.name, self.notices = inner.name, inner.notices
        self.mask_in_kernel, self.cuda_graphs = inner.mask_in_kernel, inner.cuda_graphs
        self.active = False
        self.ns: dict[str, int] = defaultdict(int)
        self.flops: dict[str, float] = defaultdict(float)  # work_of's sums, per category
        self.bytes: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        self.ns.clear()
        self.flops.clear()
        self.bytes.clear()

    def work_per_run(self, runs: int) -> dict[str, tuple[float, float]]:
        """(flops, bytes) per run of each category that counts work (see work_of)."""
        return {c: (self.flops[c] / runs, self.bytes.get(c, 0.0) / runs) for c in self.flops if self.flops[c]}

    def _count(self, category: str, a: NodeArgs[Tensor]) -> None:
        flops, nbytes = work_of(a)
        if flops:
            self.flops[category] += flops
            self.bytes[category] += nbytes

    def split_ms(self, runs: int, wall_ms: float) -> dict[str, float]:
        """ms per run by category over `runs` timed runs that took `wall_ms` each on average; what
        no op accounts for is "overhead" (Python and the graph between the ops)."""
        out = {c: self.ns.get(c, 0) / 1e6 / runs for c in CATEGORIES if c != "overhead"}
        out["overhead"] = max(0.0, wall_ms - sum(out.values()))
        return out

    def _timed(self, category: str, call: Callable[[], R]) -> R:
        if not self.active:
            return call()
        t0 = time.perf_counter_ns()
        try:
            return call()
        finally:
            self.ns[category] += time.perf_counter_ns() - t0

    def machine_peaks(self) -> MachinePeaks | None:
        """The CPU's peaks on the backend's threads, for the C backends (measured once a process;
        call it outside the timed runs); None for the torch reference and CUDA backends."""
        if isinstance(self.inner, CpuOps):
            return measure_peaks(self.inner.kernels.library, self.inner.kernels.n_threads)
        return None

    # -- the inner backend's own ----------------------------------------------------------------
    def fallback(self) -> Ops:
        """Ops called directly (not as graph nodes) that this proxy does not time."""
        return self.inner

    @property
    def graph_runner(self) -> GraphRunner | None:
        return self.inner.graph_runner

    def prepare_weights(self, weights: list[QWeight]) -> None:
        self.inner.prepare_weights(weights)

    def argmax_rows(self, logits: Tensor) -> list[int]:
        return self.inner.argmax_rows(logits)

    def held_bytes(self) -> int:
        return self.inner.held_bytes()

    def extra_read_bytes(self) -> int:
        return self.inner.extra_read_bytes()

    def kernel_path(self, ggml_type: int) -> str:
        return self.inner.kernel_path(ggml_type)

    def linear_scratch(self, m: int, w: QWeight) -> ScratchSpec:
        return self.inner.linear_scratch(m, w)

    def attention_scratch(self, q: tuple[int, ...], k: KVTensor, v: KVTensor, n_kv: int) -> ScratchSpec:
        return self.inner.attention_scratch(q, k, v, n_kv)

    def mul_mat_id_scratch(self, n: int, k: int, w: QWeight) -> ScratchSpec:
        return self.inner.mul_mat_id_scratch(n, k, w)

    def bind(self, a: NodeArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Step:
        """The backend's bound call for a node, with the timer around it."""
        f = self.inner.bind(a, out, scratch)
        cat = _linear_category(a.w) if isinstance(a, LinearArgs) else op_decl(a).category

        def timed() -> None:
            if not self.active:
                f()
                return
            t0 = time.perf_counter_ns()
            f()
            self.ns[cat] += time.perf_counter_ns() - t0
            self._count(cat, a)  # after the timer: counting experts reads the ids

        return timed

    # -- ops, timed -----------------------------------------------------------------------------
    def get_rows(self, w: QWeight, ids: Tensor, out: Tensor) -> Tensor:
        return self._timed("rows", lambda: self.inner.get_rows(w, ids, out))

    def linear(self, x: Tensor, w: QWeight, out: Tensor, scratch: list[Tensor] | None = None) -> Tensor:
        cat = _linear_category(w)
        if self.active:
            self._count(cat, LinearArgs(x, w))
        return self._timed(cat, lambda: self.inner.linear(x, w, out, scratch))

    def mul_mat_id(self, a: MulMatIdArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        if self.active:
            self._count("matmul", a)
        return self._timed("matmul", lambda: self.inner.mul_mat_id(a, out, scratch))

    def moe_topk(self, a: MoeTopKArgs[Tensor], out: Tensor) -> Tensor:
        return self._timed("rows", lambda: self.inner.moe_topk(a, out))

    def moe_weights(self, a: MoeWeightsArgs[Tensor], out: Tensor) -> Tensor:
        return self._timed("elementwise", lambda: self.inner.moe_weights(a, out))

    def moe_sum(self, x: Tensor, weights: Tensor, out: Tensor) -> Tensor:
        return self._timed("elementwise", lambda: self.inner.moe_sum(x, weights, out))

    def rms_norm(self, x: Tensor, w: Tensor, eps: float, out: Tensor, scratch: list[Tensor]) -> Tensor:
        return self._timed("norm", lambda: self.inner.rms_norm(x, w, eps, out, scratch))

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, neox: bool, out: Tensor) -> Tensor:
        return self._timed("rope", lambda: self.inner.rope(x, cos, sin, neox, out))

    def scale(self, x: Tensor, s: float, out: Tensor) -> Tensor:
        return self._timed("elementwise", lambda: self.inner.scale(x, s, out))

    def add(self, a: Tensor, b: Tensor, out: Tensor) -> Tensor:
        return self._timed("elementwise", lambda: self.inner.add(a, b, out))

    def glu(self, gate: Tensor, up: Tensor, act: str, out: Tensor) -> Tensor:
        return self._timed("elementwise", lambda: self.inner.glu(gate, up, act, out))

    def rows(self, x: Tensor, idx: Tensor, out: Tensor) -> Tensor:
        return self._timed("rows", lambda: self.inner.rows(x, idx, out))

    def softcap(self, x: Tensor, c: float, out: Tensor) -> Tensor:
        return self._timed("elementwise", lambda: self.inner.softcap(x, c, out))

    def kv_store(self, kv: KVTensor, cells: Tensor, x: Tensor, scratch: list[Tensor] | None = None) -> None:
        self._timed("kv_write", lambda: self.inner.kv_store(kv, cells, x, scratch))

    def kv_rows(self, kv: KVTensor, cells: Tensor) -> Tensor:
        return self.inner.kv_rows(kv, cells)

    def attention(self, a: AttentionArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        if self.active:
            self._count("attention", a)
        return self._timed("attention", lambda: self.inner.attention(a, out, scratch))

    def rope_cache(
        self, pos: Tensor, n_rot: int, base: float, scale: float, freq_factors: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        return self._timed("rope", lambda: self.inner.rope_cache(pos, n_rot, base, scale, freq_factors))


__all__ = ["OP_CATEGORY", "CATEGORIES", "CATEGORY_TITLES", "ProfilingOps", "work_of"]
