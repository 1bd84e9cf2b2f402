"""The CUDA backend: every op of a layer is a Triton kernel reading the weights as GGUF blocks
in device memory (kernels/cuda/triton/), so the weight slab is the file's tensor bytes.

Matmuls of the types kernels/cuda/triton/matmul.py covers dequantise inside the kernel; any other
type is dequantised on the device at each use, with a one-time notice. Norms, RoPE, the gated
activation, element-wise ops, the embedding gather, K/V writes and attention are Triton kernels
too; a layout they do not cover (never produced by engine/graph/forward.py) takes the torch
reference's code on the same device (the `TorchOps` it holds). `bind` fuses gemma's post-norm
with the residual add that follows it, and no op waits on the host, so a decode step can be
captured in a CUDA graph (kernels/cuda/graphs.py, the backend's own runner). Without a GPU the
same kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1): that is how the
backend is tested end to end on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from ubatch.kernels.cuda.graphs import CudaGraphRunner
from ubatch.kernels.cuda.triton import mode
from ubatch.kernels.ops import (
    AddArgs,
    AttentionArgs,
    GraphRunner,
    KVTensor,
    LoraArgs,
    MulMatIdArgs,
    NodeArgs,
    Ops,
    RmsNormArgs,
    ScratchSpec,
    Step,
    attn_scratch,
    attn_scratch_count,
)
from ubatch.kernels.quant.dequant import dequantize, type_name
from ubatch.kernels.quant.weight import QWeight
from ubatch.kernels.torch_ops import TorchOps


def _rows_ok(*ts: Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)


class _Step:
    """A bound call that a later node may absorb (the post-norm folded into the add after it)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn: Callable[[], object] | None = fn

    def __call__(self) -> None:
        if self.fn is not None:
            self.fn()


class CudaOps(Ops):
    name = "cuda"
    mask_in_kernel = True  # the attention kernel applies the mask rules to the cells itself

    def __init__(self, n_threads: int = 1) -> None:
        self.ref = TorchOps(n_threads)  # the layouts the kernels do not cover, on the same device
        self.notices: list[str] = []
        self.interpreted = mode.use_interpreter_without_gpu()
        from ubatch.kernels.cuda.triton import attention, elementwise, gather, lora, matmul, moe

        self._ta, self._te, self._tg, self._mm, self._moe = attention, elementwise, gather, matmul, moe
        self._lora = lora
        self.cuda_graphs = not self.interpreted  # decode steps captured and replayed
        self._runner = CudaGraphRunner()
        self._noticed: set[int] = set()
        self.fused = 0  # post-norm + residual add pairs bound as one kernel
        self._last: tuple[_Step, RmsNormArgs[Tensor], Tensor] | None = None
        if self.interpreted:
            self.notices.append("cuda backend: no CUDA GPU, the Triton kernels run in the interpreter (slow)")

    @property
    def graph_runner(self) -> GraphRunner | None:
        return self._runner if self.cuda_graphs else None

    def fallback(self) -> Ops:
        return self.ref

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

    def held_bytes(self) -> int:
        return 0

    def kernel_path(self, ggml_type: int) -> str:
        if ggml_type not in self._mm.SUPPORTED:
            return "dequantise per use on the device + torch.mm"
        rows = self._mm.GEMV_MAX_ROWS
        return f"Triton: fused dequant GEMV (<= {rows} rows), dequantised tiles + tl.dot (more rows)"

    def linear_scratch(self, m: int, w: QWeight) -> ScratchSpec:
        return []

    def attention_scratch(self, q: tuple[int, ...], k: KVTensor, v: KVTensor, n_kv: int) -> ScratchSpec:
        """What the attention node really uses, so the compute buffer counts it: the Triton
        kernel's split-decode partials (nothing for one pass), or the reference's tiles for a
        cache type the kernel does not read."""
        ta = self._ta
        if k.ggml_type in ta.KV_TYPES and v.ggml_type in ta.KV_TYPES:
            g, t, h, d = q
            n = ta.partials(g, t, h, d, k.n_head, n_kv, v.head_dim, k.ggml_type == ta.T.Q8_0)
            return [((n,), torch.float32)] if n else []
        return super().attention_scratch(q, k, v, n_kv)

    # -- binding: one call per node, the post-norm + residual add fused ---------------------------
    def bind(self, a: NodeArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Step:
        last, self._last = self._last, None
        if isinstance(a, AddArgs) and last is not None:
            step, norm, norm_out = last
            if a.b.data_ptr() == norm_out.data_ptr() and a.b.shape == a.a.shape == out.shape and _rows_ok(a.a, out):
                step.fn = None  # the norm runs inside the add's kernel
                self.fused += 1
                return functools.partial(self._te.rms_norm, norm.x, norm.w, norm.eps, norm_out, a.a, out)
        if isinstance(a, RmsNormArgs):
            step = _Step(super().bind(a, out, scratch))
            if _rows_ok(a.x, a.w, out):
                self._last = (step, a, out)
            return step
        return super().bind(a, out, scratch)

    # -- ops ------------------------------------------------------------------------------------
    def get_rows(self, w: QWeight, ids: Tensor, out: Tensor) -> Tensor:
        if w.ggml_type in self._tg.GET_ROWS_TYPES and out.is_contiguous() and ids.dtype == torch.int64:
            return self._tg.get_rows(w, ids.contiguous(), out)
        return out.copy_(w.rows(ids))

    def linear(self, x: Tensor, w: QWeight, out: Tensor, scratch: list[Tensor] | None = None) -> Tensor:
        if x.shape[0] == 0:
            return out
        if x.stride(1) != 1:
            x = x.contiguous()
        if w.ggml_type in self._mm.SUPPORTED and out.stride(1) == 1:
            return self._mm.linear(x, w, out)
        return torch.mm(x, dequantize(w.raw, w.ggml_type, w.shape).t(), out=out)

    def mul_mat_id(self, a: MulMatIdArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        """The chosen experts' rows from the stored blocks (triton/moe.py); the ids stay on the device."""
        x, ids, b = a.x, a.ids, a.b
        if (
            a.w.ggml_type in self._mm.SUPPORTED
            and x.is_contiguous()
            and out.is_contiguous()
            and ids.is_contiguous()
            and ids.dtype == torch.int32
            and (b is None or b.is_contiguous())
        ):
            return self._moe.mul_mat_id(x, a.w, ids, b, out)
        return self.ref.mul_mat_id(a, out, scratch)

    def lora(self, a: LoraArgs[Tensor], out: Tensor) -> Tensor:
        """Every adapter of the ubatch in one launch (triton/lora.py); ids and scales stay on the device."""
        if self._lora.supported(a, out):
            return self._lora.lora(a, out)
        return self.ref.lora(a, out)

    def rms_norm(self, x: Tensor, w: Tensor, eps: float, out: Tensor, scratch: list[Tensor]) -> Tensor:
        if _rows_ok(x, w, out):
            return self._te.rms_norm(x, w, eps, out)
        return self.ref.rms_norm(x, w, eps, out, scratch)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, neox: bool, out: Tensor) -> Tensor:
        if x.stride(-1) == out.stride(-1) == 1 and _rows_ok(cos, sin) and x.dtype == out.dtype == torch.float32:
            return self._te.rope(x, cos, sin, neox, out)
        return self.ref.rope(x, cos, sin, neox, out)

    def _elementwise(self, op: int, a: Tensor, b: Tensor | None, s: float, out: Tensor) -> bool:
        if not _rows_ok(a, out) or (b is not None and (not _rows_ok(b) or b.shape != a.shape)):
            return False
        self._te.elementwise(op, a, b, s, out)
        return True

    def scale(self, x: Tensor, s: float, out: Tensor) -> Tensor:
        return out if self._elementwise(self._te.OP_SCALE, x, None, s, out) else self.ref.scale(x, s, out)

    def add(self, a: Tensor, b: Tensor, out: Tensor) -> Tensor:
        return out if self._elementwise(self._te.OP_ADD, a, b, 0.0, out) else self.ref.add(a, b, out)

    def softcap(self, x: Tensor, c: float, out: Tensor) -> Tensor:
        return out if self._elementwise(self._te.OP_SOFTCAP, x, None, c, out) else self.ref.softcap(x, c, out)

    def add_bias(self, x: Tensor, b: Tensor, out: Tensor) -> Tensor:
        if _rows_ok(x, out, b) and x.dim() and b.numel() == x.shape[-1] and b.dtype == torch.float32:
            self._te.elementwise(self._te.OP_BIAS, x, b, 0.0, out)
            return out
        return self.ref.add_bias(x, b, out)

    def glu(self, gate: Tensor, up: Tensor, act: str, out: Tensor) -> Tensor:
        if act in ("gelu_tanh", "silu") and _rows_ok(gate, up, out):
            return self._te.glu(gate, up, act, out)
        return self.ref.glu(gate, up, act, out)

    def rows(self, x: Tensor, idx: Tensor, out: Tensor) -> Tensor:
        if _rows_ok(x, out) and idx.dtype == torch.int64 and idx.is_contiguous():
            return self._tg.rows(x, idx, out)
        return self.ref.rows(x, idx, out)

    def kv_store(self, kv: KVTensor, cells: Tensor, x: Tensor, scratch: list[Tensor] | None = None) -> None:
        if kv.ggml_type in self._tg.KV_STORE_TYPES and _rows_ok(x) and kv.data.is_contiguous():
            self._tg.kv_store(kv.data, kv.ggml_type, cells.long().contiguous(), x)
        else:
            self.ref.kv_store(kv, cells, x, scratch)

    def kv_rows(self, kv: KVTensor, cells: Tensor) -> Tensor:
        return self.ref.kv_rows(kv, cells)

    def attention(self, a: AttentionArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        """The Triton kernel reads the cells and the mask tile by tile, or with `cells` applies
        the mask rules itself; its scratch is the split partials (`attention_scratch`). A cache
        type the kernel does not read takes the reference, which builds the mask from the cells."""
        ta = self._ta
        mask_ok = a.cells is not None or (
            a.mask is not None and a.mask.dtype == torch.float16 and a.mask.stride(-1) == 1
        )
        if (
            a.sinks is None  # gpt-oss's sinks: the reference's loop
            and a.k.ggml_type in ta.KV_TYPES
            and a.v.ggml_type in ta.KV_TYPES
            and a.q.stride(-1) == 1
            and _rows_ok(out)
            and mask_ok
        ):
            part = scratch[0] if len(scratch) == 1 else None  # the planned split partials
            return ta.attention(a, out, part=part)
        if len(scratch) < attn_scratch_count(a.k.n_head):  # a cache type the kernel does not read
            g, t, h, d = a.q.shape
            shapes = attn_scratch(g, t, h, a.k.n_head, a.n_kv, d, a.v.head_dim)
            scratch = [torch.empty(s, dtype=dt, device=out.device) for s, dt in shapes]
        return self.ref.attention(a, out, scratch)

    def rope_cache(
        self, pos: Tensor, n_rot: int, base: float, scale: float, freq_factors: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.ref.rope_cache(pos, n_rot, base, scale, freq_factors)


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
