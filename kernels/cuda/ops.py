"""The CUDA backend: every op of a layer is a Triton kernel reading the weights as GGUF blocks
in device memory (kernels/triton/), so the weight slab is the file's tensor bytes.

Matmuls of the types kernels/triton/matmul.py covers dequantise inside the kernel; any other
type is dequantised on the device at each use, with a one-time notice. Norms, RoPE, the gated
activation, element-wise ops, the embedding gather, K/V writes and attention are Triton kernels
too; a layout they do not cover (never produced by engine/forward.py) takes the torch
reference's code on the same device. `bind` fuses gemma's post-norm with the residual add that
follows it, and no op waits on the host, so a decode step can be captured in a CUDA graph
(engine/cuda_graphs.py). Without a GPU the same kernels run in Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1): that is how the backend is tested end to end on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ubatch.kernels.cuda.triton import mode
from ubatch.kernels.ops import KVTensor, ScratchSpec, attn_scratch
from ubatch.kernels.quant.dequant import dequantize, type_name
from ubatch.kernels.quant.weight import QWeight
from ubatch.kernels.torch_ops import TorchOps

_PLAIN_OPS = frozenset({"get_rows", "linear", "rope", "scale", "add", "glu", "rows", "softcap"})


def _rows_ok(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)


class _Step:
    """A bound call that a later node may absorb (the post-norm folded into the add after it)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn: Callable[[], Any] | None = fn

    def __call__(self) -> None:
        if self.fn is not None:
            self.fn()


class CudaOps(TorchOps):
    name = "cuda"
    mask_in_kernel = True  # the attention kernel applies the mask rules to the cells itself

    def __init__(self, n_threads: int = 1) -> None:
        super().__init__(n_threads)
        self.interpreted = mode.use_interpreter_without_gpu()
        from ubatch.kernels.cuda.triton import attention, elementwise, gather, matmul

        self._ta, self._te, self._tg, self._mm = attention, elementwise, gather, matmul
        self.cuda_graphs = not self.interpreted  # engine/cuda_graphs.py captures decode steps
        self._noticed: set[int] = set()
        self.fused = 0  # post-norm + residual add pairs bound as one kernel
        self._last: tuple[_Step, torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None
        if self.interpreted:
            self.notices.append("cuda backend: no CUDA GPU, the Triton kernels run in the interpreter (slow)")

    # -- weights --------------------------------------------------------------------------------
    def prepare_weights(self, weights: list[QWeight]) -> None:
        """Nothing is repacked; the weights must already be in device memory (Model.load)."""
        for w in weights:
            if not self.interpreted and w.raw.device.type != "cuda":
                raise ValueError(f"the cuda backend needs the weights on the GPU ({w.name} is on {w.raw.device})")
            if w.ggml_type not in self._mm.SUPPORTED and w.ggml_type not in self._noticed:
                self._noticed.add(w.ggml_type)
                self.notices.append(
                    f"{type_name(w.ggml_type)} has no Triton matmul kernel: those tensors are dequantised on the device at each use (slower)"
                )
        self._weights += [w for w in weights if w not in self._weights]

    def held_bytes(self) -> int:
        return 0

    def kernel_path(self, ggml_type: int) -> str:
        if ggml_type not in self._mm.SUPPORTED:
            return "dequantise per use on the device + torch.mm"
        rows = self._mm.GEMV_MAX_ROWS
        return f"Triton: fused dequant GEMV (<= {rows} rows), dequantised tiles + tl.dot (more rows)"

    def linear_scratch(self, m: int, w: QWeight) -> ScratchSpec:
        return []

    def attention_scratch(
        self, g: int, t: int, h: int, n_head_kv: int, n_kv: int, d: int, dv: int, type_k: int, type_v: int
    ) -> ScratchSpec:
        """What the attention node really uses, so the compute buffer counts it: the Triton
        kernel's split-decode partials (nothing for one pass), or the reference's tiles for a
        cache type the kernel does not read."""
        if type_k in self._ta.KV_TYPES and type_v in self._ta.KV_TYPES:
            n = self._ta.partials(g, t, h, d, n_head_kv, n_kv, dv, type_k == self._ta.T.Q8_0)
            return [((n,), torch.float32)] if n else []
        return attn_scratch(g, t, h, n_head_kv, n_kv, d, dv)

    # -- binding: one call per node, the post-norm + residual add fused ---------------------------
    def bind(
        self, op: str, args: list, out: torch.Tensor | None, scratch: list[torch.Tensor]
    ) -> Callable[[], Any] | None:
        last, self._last = self._last, None
        if op == "add" and last is not None:
            step, x, w, eps, norm_out = last
            a, b = args
            if b.data_ptr() == norm_out.data_ptr() and b.shape == a.shape == out.shape and _rows_ok(a, out):
                step.fn = None  # the norm runs inside the add's kernel
                self.fused += 1
                return functools.partial(self._te.rms_norm, x, w, eps, norm_out, a, out)
        if op == "kv_store":
            return functools.partial(self.kv_store, *args[:3], scratch)
        if op == "attention":
            q, k, v, starts, n_kv, mask, scale, visible = args[:8]
            cells = tuple(args[10:]) or None  # the mask rules' inputs (engine/forward.py)
            return functools.partial(self.attention, q, k, v, starts, n_kv, mask, scale, out, scratch, visible, cells)
        if op == "rms_norm":
            x, w, eps = args
            step = _Step(functools.partial(self.rms_norm, x, w, eps, out, scratch))
            if _rows_ok(x, w, out):
                self._last = (step, x, w, eps, out)
            return step
        if op in _PLAIN_OPS:
            return functools.partial(getattr(self, op), *args, out=out)
        return None  # anything else: the graph's generic call of the method

    # -- ops ------------------------------------------------------------------------------------
    def get_rows(self, w: QWeight, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if w.ggml_type in self._tg.GET_ROWS_TYPES and out.is_contiguous() and ids.dtype == torch.int64:
            return self._tg.get_rows(w, ids.contiguous(), out)
        return out.copy_(w.rows(ids))

    def linear(
        self, x: torch.Tensor, w: QWeight, out: torch.Tensor, scratch: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        if x.shape[0] == 0:
            return out
        if x.stride(1) != 1:
            x = x.contiguous()
        if w.ggml_type in self._mm.SUPPORTED and out.stride(1) == 1:
            return self._mm.linear(x, w, out)
        return torch.mm(x, dequantize(w.raw, w.ggml_type, w.shape).t(), out=out)

    def rms_norm(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor, scratch: list[torch.Tensor]
    ) -> torch.Tensor:
        if _rows_ok(x, w, out):
            return self._te.rms_norm(x, w, eps, out)
        return super().rms_norm(x, w, eps, out, scratch)

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool, out: torch.Tensor
    ) -> torch.Tensor:
        if x.stride(-1) == out.stride(-1) == 1 and _rows_ok(cos, sin) and x.dtype == out.dtype == torch.float32:
            return self._te.rope(x, cos, sin, neox, out)
        return super().rope(x, cos, sin, neox, out)

    def _elementwise(self, op: int, a: torch.Tensor, b: torch.Tensor | None, s: float, out: torch.Tensor) -> bool:
        if not _rows_ok(a, out) or (b is not None and (not _rows_ok(b) or b.shape != a.shape)):
            return False
        self._te.elementwise(op, a, b, s, out)
        return True

    def scale(self, x: torch.Tensor, s: float, out: torch.Tensor) -> torch.Tensor:
        return out if self._elementwise(self._te.OP_SCALE, x, None, s, out) else super().scale(x, s, out)

    def add(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out if self._elementwise(self._te.OP_ADD, a, b, 0.0, out) else super().add(a, b, out)

    def softcap(self, x: torch.Tensor, c: float, out: torch.Tensor) -> torch.Tensor:
        return out if self._elementwise(self._te.OP_SOFTCAP, x, None, c, out) else super().softcap(x, c, out)

    def glu(self, gate: torch.Tensor, up: torch.Tensor, act: str, out: torch.Tensor) -> torch.Tensor:
        if act in ("gelu_tanh", "silu") and _rows_ok(gate, up, out):
            return self._te.glu(gate, up, act, out)
        return super().glu(gate, up, act, out)

    def rows(self, x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if _rows_ok(x, out) and idx.dtype == torch.int64 and idx.is_contiguous():
            return self._te.rows(x, idx, out)
        return super().rows(x, idx, out)

    def kv_store(
        self, kv: KVTensor, cells: torch.Tensor, x: torch.Tensor, scratch: list[torch.Tensor] | None = None
    ) -> None:
        if kv.ggml_type in self._tg.KV_STORE_TYPES and _rows_ok(x) and kv.data.is_contiguous():
            self._tg.kv_store(kv.data, kv.ggml_type, cells.long().contiguous(), x)
        else:
            super().kv_store(kv, cells, x, scratch)

    def attention(
        self,
        q: torch.Tensor,
        k: KVTensor,
        v: KVTensor,
        starts: torch.Tensor,
        n_kv: int,
        mask: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        scratch: list[torch.Tensor],
        visible: torch.Tensor | None = None,
        cells: tuple | None = None,
    ) -> torch.Tensor:
        """The Triton kernel reads the cells and the mask tile by tile, or with `cells` applies
        the mask rules itself; its scratch is the split partials (`attention_scratch`). A cache type the kernel does not read takes the reference, with the mask
        built from the cells for that call."""
        ta = self._ta
        mask_ok = cells is not None or (mask.dtype == torch.float16 and mask.stride(-1) == 1)
        if (
            k.ggml_type in ta.KV_TYPES
            and v.ggml_type in ta.KV_TYPES
            and q.stride(-1) == 1
            and _rows_ok(out)
            and mask_ok
        ):
            if visible is None:
                visible = torch.ones(-(-n_kv // 256), dtype=torch.bool, device=q.device)
            part = scratch[0] if len(scratch) == 1 else None  # the planned split partials
            return ta.attention(q, k, v, starts.to(q.device), n_kv, mask, scale, out, visible, cells, part=part)
        if cells is not None:
            mask = mask_from_cells(q.shape[1], cells)
        return super().attention(q, k, v, starts, n_kv, mask, scale, out, scratch, visible)


def mask_from_cells(t: int, cells: tuple) -> torch.Tensor:
    """The additive (G, T, n_kv) f16 mask the rules give (as KVCache.mask), for the reference path."""
    cpos, cseq, qpos, qseq, n_swa, qlim = cells
    g = cpos.shape[0]
    qp, ql, qs = (x.view(g, t, 1) for x in (qpos, qlim, qseq))
    vis = (cpos[:, None, :] >= 0) & ((cseq[:, None, :] & qs) != 0) & (cpos[:, None, :] <= ql)
    if n_swa > 0:
        vis &= qp - cpos[:, None, :] < n_swa
    zero = torch.zeros((), dtype=torch.float16, device=cpos.device)
    return torch.where(vis, zero, torch.tensor(float("-inf"), dtype=torch.float16, device=cpos.device))


def available() -> str | None:
    """None when the backend can run compiled here; otherwise why not."""
    if torch.cuda.is_available():
        return None
    if mode.interpreted():
        return None
    return "no CUDA GPU (TRITON_INTERPRET=1 runs its kernels in Triton's interpreter on the CPU, slowly)"


def create(n_threads: int = 1) -> CudaOps:
    why = available()
    if why is not None:
        raise OSError(why)
    return CudaOps(n_threads)
