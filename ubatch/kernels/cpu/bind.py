"""The loaded C kernels and the binding of graph nodes to them: a decode step then costs one
ctypes call per node, or per run of nodes once fused.

A graph's tensors are views of a workspace at fixed offsets, so every pointer, shape and stride
an op needs is known when the graph is bound; `CpuKernels.bind` turns a node into a
`CCall(op, lib.ub_..., <pointers and sizes>)` (kernels/cpu/program.py, which also fuses runs of
them into one call). A node the C kernels do not cover (or whose tensors are not laid out as they
expect) gets None and stays a call of the backend's Python method.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T
from torch import Tensor

from ubatch.kernels import ops
from ubatch.kernels.cpu.build import CpuLibrary
from ubatch.kernels.cpu.program import CCall
from ubatch.kernels.quant.dequant_iq import KERNELS as IQ_KERNELS
from ubatch.kernels.quant.repack import Repacks
from ubatch.kernels.quant.weight import QWeight

GEMV_MAX_ROWS = 16  # measured: the fused kernel beats dequantise + GEMM up to here
ATTN_MAX_ROWS = 4  # query rows per group read straight from the cache; more: the chunked GEMMs
# measured (one layer's GEMMs, 2 threads, Intel Xeon with AMX): the AMX GEMM 1.3-1.4x the f32 one
# at 128-512 rows, 1.1-1.2x at 64, 1.0-1.2x at 32-48 (there splitting the weights into tiles
# costs about as much as the products)
AMX_MIN_ROWS = 64
TILE_MIN_ROWS = 64  # a GEMM tile narrower than this loses BLAS efficiency
# MXFP4, the IQ and TQ types (csrc/quant_iq.c): f32 weights decoded a chunk at a time, also on AVX2
IQ_TYPES = frozenset(int(t) for t in IQ_KERNELS)
# of those, the ones whose AVX2 GEMV multiplies their int8 table values with x as 16-bit integers
IQ_X16_TYPES = frozenset(int(t) for t in (T.MXFP4, T.IQ4_NL, T.IQ4_XS))
KERNEL_TYPES = (
    frozenset(int(t) for t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K))
    | IQ_TYPES
)


LORA_TYPES = {torch.float32: int(T.F32), torch.float16: int(T.F16), torch.bfloat16: int(T.BF16)}  # csrc/lora.c
GATING_CODES = {"softmax": 0, "sigmoid": 1, "softmax_weight": 2}  # csrc/moe.c


def tile_rows(m: int, n: int) -> int:
    """Weight rows dequantised per GEMM tile for an m-row product: as many as activation rows
    (so the tile is no bigger than the input it multiplies), at least TILE_MIN_ROWS."""
    return min(n, max(TILE_MIN_ROWS, m))


def _f32(*ts: Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)


class CpuKernels:
    """The C library of this CPU with what the kernels need to know besides pointers: threads,
    the weights' repacked layouts, the scratch each product asks for (the plan and the binding
    both ask here)."""

    def __init__(self, library: CpuLibrary, n_threads: int, no_amx: bool = False) -> None:
        self.library = library
        self.lib = library.lib
        self.n_threads = max(1, n_threads)
        # the register-blocked GEMM (csrc/gemm.c; 512-bit where the CPU has AVX-512F): measured
        # above MKL's f32 GEMM on Zen 3 (107-125 against 78-121 GFLOP/s) and on Zen 5 (383-413
        # against 176-185); the portable build has none
        self.has_gemm = library.simd != "portable"
        # AMX tiles for prefill's GEMM where the library has them (build.py); `cpu-noamx` keeps the
        # f32 FMA kernel for comparison
        self.amx = library.amx and not no_amx
        self.repacks = Repacks(library.simd == "avx2")  # Q5_0 as Q8_0 for the AVX2 GEMV
        # the AVX2 build multiplies block types' codes with x as 16-bit integers (csrc/quant_i16.h)
        self.x16 = library.simd == "avx2"
        # the AVX-512 build's decode GEMV multiplies the K-quants' codes with x as 16-bit integers,
        # one scale per 256 values (csrc/gemv_vnni.c; 1: AVX512-BW, 2: with VNNI's vpdpwssd)
        self.vnni = int(self.lib.ub_vnni()) if library.simd == "avx512" else 0

    def amx_scratch(self, m: int) -> int:
        """Floats of scratch the AMX GEMM needs for m rows (0: an m-row product skips the tiles):
        x split into tiles, per-thread panels."""
        return int(self.lib.ub_gemm_amx_scratch(m, self.n_threads)) if self.amx and m >= AMX_MIN_ROWS else 0

    def gemm_scratch(self, m: int, w: QWeight) -> int:
        """Floats of scratch the GEMM needs for m rows: per-thread weight panels, and on AVX2 x as
        16-bit integers (csrc/quant_i16.h)."""
        return int(self.lib.ub_gemm_scratch(self.repacks.kernel_type(w), m, w.shape[1], self.n_threads))

    def gemv_scratch(self, m: int, w: QWeight) -> int:
        """Floats of scratch the fused GEMV needs for m rows (x reordered for the AVX2 decoders)."""
        return int(self.lib.ub_gemv_scratch(self.repacks.kernel_type(w), m, w.shape[1]))

    def dequant_rows(self, w: QWeight, r0: int, n: int, tile: Tensor) -> None:
        """Rows [r0, r0 + n) of w dequantised into tile (the portable GEMM's BLAS tiles)."""
        self.lib.ub_dequant_rows(
            w.ggml_type, w.raw.data_ptr(), w.row_bytes, r0, n, w.shape[1], tile.data_ptr(), self.n_threads
        )

    def bind(self, a: ops.NodeArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> ops.Step | None:
        """A zero-argument C call computing the node, or None to keep the Python method."""
        lib, nth, o = self.lib, self.n_threads, out.data_ptr()
        match a:
            case ops.LinearArgs():
                return self.linear(a.x, a.w, out, scratch)
            case ops.GetRowsArgs():
                return self.get_rows(a.w, a.ids, out)
            case ops.RmsNormArgs():
                return self.rms_norm(a.x, a.w, a.eps, out)
            case ops.RopeArgs():
                return self.rope(a.x, a.cos, a.sin, a.neox, out)
            case ops.GluArgs():
                return self.glu(a.gate, a.up, a.act, out)
            case ops.AddArgs():
                if not _f32(a.a, a.b, out) or a.a.shape != a.b.shape:
                    return None
                return CCall("add", lib.ub_add, (a.a.data_ptr(), a.b.data_ptr(), a.a.numel(), o, nth))
            case ops.ScaleArgs():
                if not _f32(a.x, out):
                    return None
                return CCall("scale", lib.ub_scale, (a.x.data_ptr(), a.s, a.x.numel(), o, nth))
            case ops.LoraArgs():
                return self.lora(a, out)
            case ops.RowsArgs():
                x, idx = a.x, a.idx
                if not _f32(x, out) or idx.dtype != torch.int64 or not idx.is_contiguous():
                    return None
                return CCall("rows", lib.ub_rows, (x.data_ptr(), idx.data_ptr(), idx.numel(), x[0].numel(), o))
            case ops.KVStoreArgs():
                return self.kv_store(a.kv, a.cells, a.x)
            case ops.BiasArgs():
                return self.add_bias(a.x, a.b, out)
            case ops.SoftcapArgs():
                return self.softcap(a.x, a.c, out)
            case ops.AttentionArgs():
                return self.attention(a, out)
            case ops.MulMatIdArgs():
                return self.mul_mat_id(a, out, scratch)
            case ops.MoeTopKArgs():
                return self.moe_topk(a, out)
            case ops.MoeWeightsArgs():
                return self.moe_weights(a, out)
            case ops.MoeSumArgs():
                if not _f32(a.x, a.weights, out):
                    return None
                n, k, d = a.x.shape
                return CCall("moe_sum", lib.ub_moe_sum, (a.x.data_ptr(), a.weights.data_ptr(), n, k, d, o, nth))
        return None

    # -- one op each: the C call, or None where the kernels do not cover the types or layout -----
    def linear(self, x: Tensor, w: QWeight, out: Tensor, scratch: list[Tensor]) -> ops.Step | None:
        """Decode's fused GEMV (scratch planned, or the call's own), prefill's GEMM."""
        w = self.repacks.layout(w)
        m, (n, k) = x.shape[0], w.shape
        if m == 0:
            return lambda: None
        if w.ggml_type not in KERNEL_TYPES or x.stride(1) != 1 or x.stride(0) < k or out.stride(1) != 1:
            return None
        if m > GEMV_MAX_ROWS:
            return self._gemm(x, w, out, scratch)
        if not out.is_contiguous():
            return None
        need = self.gemv_scratch(m, w)
        buf = scratch[0] if scratch and scratch[0].numel() >= need else torch.empty(need)
        args = (w.ggml_type, w.raw.data_ptr(), w.row_bytes, n, k, x.data_ptr(), m, x.stride(0))
        tail = (out.data_ptr(), out.stride(0), buf.data_ptr() if need else 0, self.n_threads)
        call = CCall("gemv", self.lib.ub_gemv, (*args, *tail))
        call.keep = buf
        return call

    def _gemm(self, x: Tensor, w: QWeight, out: Tensor, scratch: list[Tensor]) -> CCall | None:
        """Prefill's product where this build has it and the scratch is planned: on AMX tiles
        (csrc/amx.c) from AMX_MIN_ROWS rows where the backend uses them, else the f32 FMA
        kernel (csrc/gemm.c)."""
        (n, k), m = w.shape, x.shape[0]
        if not self.has_gemm or w.ggml_type == T.F32 or not scratch:
            return None
        op, fn, need = "gemm", self.lib.ub_gemm, self.gemm_scratch(m, w)
        if self.amx_scratch(m):
            op, fn, need = "gemm_amx", self.lib.ub_gemm_amx, self.amx_scratch(m)
        if scratch[0].numel() < need:
            return None
        args = (w.ggml_type, w.raw.data_ptr(), w.row_bytes, n, k, x.data_ptr(), m, x.stride(0))
        return CCall(op, fn, (*args, out.data_ptr(), out.stride(0), scratch[0].data_ptr(), self.n_threads))

    def mul_mat_id_scratch(self, n: int, k: int, w: QWeight) -> int:
        """Floats of scratch mul_mat_id needs for n tokens choosing k experts each (csrc/moe.c)."""
        _, rows, cols = w.shape
        return int(self.lib.ub_mul_mat_id_scratch(self.repacks.kernel_type(w), rows, cols, n, k, self.n_threads))

    def mul_mat_id(self, a: ops.MulMatIdArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> CCall | None:
        """The chosen experts' products grouped by expert (csrc/moe.c), from the planned scratch."""
        w, x, ids, b = self.repacks.layout(a.w), a.x, a.ids, a.b
        n, k = ids.shape
        _, rows, cols = w.shape
        if (
            w.ggml_type not in KERNEL_TYPES
            or not _f32(x, out)
            or ids.dtype != torch.int32
            or not ids.is_contiguous()
            or (b is not None and not _f32(b))
            or not scratch
            or scratch[0].numel() < self.mul_mat_id_scratch(n, k, w)
        ):
            return None
        wa = (w.ggml_type, w.raw.data_ptr(), w.raw.numel() // w.shape[0], w.row_bytes, rows, cols)
        xa = (x.data_ptr(), x.shape[1], cols, ids.data_ptr(), n, k, w.shape[0], 0 if b is None else b.data_ptr())
        tail = (out.data_ptr(), rows, scratch[0].data_ptr(), self.n_threads)
        return CCall("mul_mat_id", self.lib.ub_mul_mat_id, (*wa, *xa, *tail))

    def lora(self, a: ops.LoraArgs[Tensor], out: Tensor) -> CCall | None:
        """The segmented LoRA product over the adapters' stack (csrc/lora.c): f32/f16/bf16 factors."""
        w, x, y, idx, sc, sel = a.w, a.x, a.y, a.idx, a.scale, a.sel
        if (
            w.a.dtype not in LORA_TYPES
            or w.bt.dtype != w.a.dtype
            or not (w.a.is_contiguous() and w.bt.is_contiguous() and _f32(x, y, out, w.c, sc))
            or w.rank.dtype != torch.int32
            or idx.dtype != torch.int32
            or not idx.is_contiguous()
            or (sel is not None and (sel.dtype != torch.int64 or not sel.is_contiguous()))
        ):
            return None
        n, (_, r_max, n_in), n_out = x.shape[0], w.a.shape, y.shape[1]
        wa = (LORA_TYPES[w.a.dtype], w.a.data_ptr(), w.bt.data_ptr(), r_max, w.rank.data_ptr(), w.c.data_ptr())
        rows = (idx.data_ptr(), sc.data_ptr(), idx.shape[1], 0 if sel is None else sel.data_ptr())
        args = (y.data_ptr(), x.data_ptr(), n, n_in, n_out, *wa, *rows, out.data_ptr(), self.n_threads)
        return CCall("lora", self.lib.ub_lora, args)

    def moe_topk(self, a: ops.MoeTopKArgs[Tensor], out: Tensor) -> CCall | None:
        lg, bias = a.logits, a.bias
        if not _f32(lg) or out.dtype != torch.int32 or not out.is_contiguous() or (bias is not None and not _f32(bias)):
            return None
        b = 0 if bias is None else bias.data_ptr()
        args = (lg.data_ptr(), lg.shape[0], lg.shape[1], a.k, GATING_CODES[a.gating], b, a.n_group, a.n_group_used)
        return CCall("moe_topk", self.lib.ub_moe_topk, (*args, out.data_ptr()))

    def moe_weights(self, a: ops.MoeWeightsArgs[Tensor], out: Tensor) -> CCall | None:
        lg, ids = a.logits, a.ids
        if not _f32(lg, out) or ids.dtype != torch.int32 or not ids.is_contiguous():
            return None
        args = (lg.data_ptr(), ids.data_ptr(), lg.shape[0], lg.shape[1], ids.shape[1], GATING_CODES[a.gating])
        return CCall("moe_weights", self.lib.ub_moe_weights, (*args, int(a.norm), a.scale, out.data_ptr()))

    def get_rows(self, w: QWeight, ids: Tensor, out: Tensor) -> CCall | None:
        w = self.repacks.layout(w)
        if w.ggml_type not in KERNEL_TYPES or ids.dtype != torch.int64 or not ids.is_contiguous():
            return None
        wa = (w.ggml_type, w.raw.data_ptr(), w.row_bytes)
        tail = (ids.data_ptr(), ids.numel(), w.shape[1], out.data_ptr(), self.n_threads)
        return CCall("get_rows", self.lib.ub_get_rows, (*wa, *tail))

    def rms_norm(self, x: Tensor, w: Tensor, eps: float, out: Tensor) -> CCall | None:
        if not _f32(x, w, out):
            return None
        n = x.shape[-1]
        args = (x.data_ptr(), n, w.data_ptr(), x.numel() // n, n, eps, out.data_ptr(), n, self.n_threads)
        return CCall("rms_norm", self.lib.ub_rms_norm, args)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, neox: bool, out: Tensor) -> CCall | None:
        if not _f32(x, cos, sin, out):
            return None
        n, h, d = x.shape
        args = (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, h, d, cos.shape[1], int(neox))
        return CCall("rope", self.lib.ub_rope, (*args, out.data_ptr(), self.n_threads))

    def glu(self, gate: Tensor, up: Tensor, act: str, out: Tensor) -> CCall | None:
        if act not in ("gelu_tanh", "silu") or not _f32(gate, up, out):
            return None
        args = (gate.data_ptr(), up.data_ptr(), gate.numel(), int(act == "gelu_tanh"), out.data_ptr())
        return CCall("glu", self.lib.ub_glu, (*args, self.n_threads))

    def add_bias(self, x: Tensor, b: Tensor, out: Tensor) -> CCall | None:
        """x (rows, n) + b (n) on contiguous rows (qwen2's Q/K/V, phi's projections)."""
        n = x.shape[-1] if x.dim() else 0
        if not _f32(x, b, out) or not (x.is_contiguous() and out.is_contiguous()) or b.numel() != n or n == 0:
            return None
        args = (x.data_ptr(), b.data_ptr(), x.numel() // n, n, out.data_ptr(), self.n_threads)
        return CCall("add_bias", self.lib.ub_add_bias, args)

    def softcap(self, x: Tensor, c: float, out: Tensor) -> CCall | None:
        """c·tanh(x / c) row by row (gemma2's final logits)."""
        n = x.shape[-1] if x.dim() else 0
        if not _f32(x, out) or not (x.is_contiguous() and out.is_contiguous()) or n == 0 or c <= 0:
            return None
        return CCall(
            "softcap", self.lib.ub_softcap, (x.data_ptr(), c, x.numel() // n, n, out.data_ptr(), self.n_threads)
        )

    def kv_store(self, kv: ops.KVTensor, cells: Tensor, x: Tensor) -> CCall | None:
        if kv.ggml_type not in (T.F32, T.F16) or not _f32(x) or not kv.data.is_contiguous():
            return None
        n = x.shape[0]
        args = (x.data_ptr(), n, x.numel() // max(n, 1), cells.data_ptr(), int(kv.ggml_type == T.F16))
        return CCall("kv_store", self.lib.ub_kv_store, (*args, kv.data.data_ptr()))

    def attention(self, a: ops.AttentionArgs[Tensor], out: Tensor) -> CCall | None:
        """Decode-shaped attention (few rows per group) over f16/f32 cells and the mask tensor,
        gemma2's soft-capped scores included."""
        q, k, v, mask = a.q, a.k, a.v, a.mask
        g, t, h, d = q.shape
        if (
            t > ATTN_MAX_ROWS
            or a.sinks is not None  # the reference's loop starts from them (its tiles are C)
            or k.ggml_type not in (T.F32, T.F16)
            or v.ggml_type not in (T.F32, T.F16)
            or not _f32(q, out)
            or mask is None
            or mask.dtype != torch.float16
            or not mask.is_contiguous()
        ):
            return None
        qa = (q.data_ptr(), g, t, h, d)
        kva = (k.data.data_ptr(), int(k.ggml_type == T.F16), v.data.data_ptr(), int(v.ggml_type == T.F16))
        rest = (k.n_head, v.head_dim, a.starts.data_ptr(), a.n_kv, mask.data_ptr(), a.scale, a.softcap, out.data_ptr())
        return CCall("attention", self.lib.ub_attn, (*qa, *kva, *rest, self.n_threads))
