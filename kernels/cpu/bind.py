"""Binding graph nodes to C calls once: a decode step then costs one ctypes call per node.

A graph's tensors are views of a workspace at fixed offsets, so every pointer, shape and stride
an op needs is known when the graph is bound; `bind_node` turns a node into
a `CCall(op, lib.ub_..., <pointers and sizes>)` (kernels/cpu_program.py, which also fuses runs of
them into one call). A node the C kernels do not cover (or whose tensors are not laid out as they
expect) stays a call of the backend's Python method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from gguf import GGMLQuantizationType as T

from ubatch.kernels.cpu.program import CCall
from ubatch.kernels.ops import KVTensor

GEMV_MAX_ROWS = 16  # measured: the fused kernel beats dequantise + GEMM up to here
ATTN_MAX_ROWS = 4  # query rows per group read straight from the cache; more: the chunked GEMMs
# measured (one layer's GEMMs, 2 threads, Intel Xeon with AMX): the AMX GEMM 1.3-1.4x the f32 one
# at 128-512 rows, 1.1-1.2x at 64, 1.0-1.2x at 32-48 (there splitting the weights into tiles
# costs about as much as the products)
AMX_MIN_ROWS = 64
TILE_MIN_ROWS = 64  # a GEMM tile narrower than this loses BLAS efficiency
KERNEL_TYPES = frozenset(
    int(t) for t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)
)


def tile_rows(m: int, n: int) -> int:
    """Weight rows dequantised per GEMM tile for an m-row product: as many as activation rows
    (so the tile is no bigger than the input it multiplies), at least TILE_MIN_ROWS."""
    return min(n, max(TILE_MIN_ROWS, m))


def _f32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)


def bind_node(
    ops: Any, op: str, a: list, out: torch.Tensor | None, scratch: list[torch.Tensor]
) -> Callable[[], Any] | None:
    """A zero-argument C call computing the node, or None to keep the Python method."""
    lib, nth = ops._lib, ops.n_threads
    if op == "linear":
        x, w = a[0], ops.repacks.layout(a[1])
        m, (n, k) = x.shape[0], w.shape
        if m == 0:
            return lambda: None
        if w.ggml_type not in KERNEL_TYPES or x.stride(1) != 1 or x.stride(0) < k or out.stride(1) != 1:
            return None
        if m > GEMV_MAX_ROWS:
            return _bind_gemm(ops, x, w, out, scratch)
        if not out.is_contiguous():
            return None
        need = ops.gemv_scratch(m, w)
        buf = scratch[0] if scratch and scratch[0].numel() >= need else torch.empty(need)  # planned, or the call's own
        call = CCall(
            "gemv",
            lib.ub_gemv,
            (
                w.ggml_type,
                w.raw.data_ptr(),
                w.row_bytes,
                n,
                k,
                x.data_ptr(),
                m,
                x.stride(0),
                out.data_ptr(),
                out.stride(0),
                buf.data_ptr() if need else 0,
                nth,
            ),
        )
        call.keep = buf
        return call
    if op == "get_rows":
        w, ids = ops.repacks.layout(a[0]), a[1]
        if w.ggml_type not in KERNEL_TYPES or ids.dtype != torch.int64 or not ids.is_contiguous():
            return None
        return CCall(
            "get_rows",
            lib.ub_get_rows,
            (w.ggml_type, w.raw.data_ptr(), w.row_bytes, ids.data_ptr(), ids.numel(), w.shape[1], out.data_ptr(), nth),
        )
    if op == "rms_norm":
        x, w, eps = a
        if not _f32(x, w, out):
            return None
        n = x.shape[-1]
        return CCall(
            "rms_norm", lib.ub_rms_norm, (x.data_ptr(), n, w.data_ptr(), x.numel() // n, n, eps, out.data_ptr(), n, nth)
        )
    if op == "rope":
        x, cos, sin, neox = a
        if not _f32(x, cos, sin, out):
            return None
        n, h, d = x.shape
        return CCall(
            "rope",
            lib.ub_rope,
            (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, h, d, cos.shape[1], int(neox), out.data_ptr(), nth),
        )
    if op == "glu":
        gate, up, act = a
        if act not in ("gelu_tanh", "silu") or not _f32(gate, up, out):
            return None
        return CCall(
            "glu",
            lib.ub_glu,
            (gate.data_ptr(), up.data_ptr(), gate.numel(), int(act == "gelu_tanh"), out.data_ptr(), nth),
        )
    if op == "add":
        x, y = a
        if not _f32(x, y, out) or x.shape != y.shape:
            return None
        return CCall("add", lib.ub_add, (x.data_ptr(), y.data_ptr(), x.numel(), out.data_ptr(), nth))
    if op == "scale":
        x, s = a
        if not _f32(x, out):
            return None
        return CCall("scale", lib.ub_scale, (x.data_ptr(), s, x.numel(), out.data_ptr(), nth))
    if op == "rows":
        x, idx = a
        if not _f32(x, out) or idx.dtype != torch.int64 or not idx.is_contiguous():
            return None
        return CCall("rows", lib.ub_rows, (x.data_ptr(), idx.data_ptr(), idx.numel(), x[0].numel(), out.data_ptr()))
    if op == "kv_store":
        kv, cells, x = a
        return _bind_kv_store(lib, kv, cells, x)
    if op == "attention":
        q, k, v, starts, n_kv, mask, scale, visible = a[:8]
        return _bind_attention(lib, nth, q, k, v, starts, n_kv, mask, scale, out)
    return None


def _bind_gemm(ops: Any, x: torch.Tensor, w: Any, out: torch.Tensor, scratch: list[torch.Tensor]) -> CCall | None:
    """Prefill's product where this build has it and the scratch is planned: on AMX tiles
    (kernels/csrc/amx.c) from AMX_MIN_ROWS rows where the backend uses them, else the f32 FMA
    kernel (kernels/csrc/gemm.c)."""
    lib, nth = ops._lib, ops.n_threads
    (n, k), m = w.shape, x.shape[0]
    if not ops.has_gemm or w.ggml_type == T.F32 or not scratch:
        return None
    op, fn, need = "gemm", lib.ub_gemm, ops.gemm_scratch
    if ops.amx_scratch(m):
        op, fn, need = "gemm_amx", lib.ub_gemm_amx, ops.amx_scratch(m)
    if scratch[0].numel() < need:
        return None
    args = (w.ggml_type, w.raw.data_ptr(), w.row_bytes, n, k, x.data_ptr(), m, x.stride(0))
    return CCall(op, fn, (*args, out.data_ptr(), out.stride(0), scratch[0].data_ptr(), nth))


def _bind_kv_store(lib: Any, kv: KVTensor, cells: torch.Tensor, x: torch.Tensor) -> Callable | None:
    if kv.ggml_type not in (T.F32, T.F16) or not _f32(x) or not kv.data.is_contiguous():
        return None
    n = x.shape[0]
    return CCall(
        "kv_store",
        lib.ub_kv_store,
        (x.data_ptr(), n, x.numel() // max(n, 1), cells.data_ptr(), int(kv.ggml_type == T.F16), kv.data.data_ptr()),
    )


def _bind_attention(
    lib: Any,
    nth: int,
    q: torch.Tensor,
    k: KVTensor,
    v: KVTensor,
    starts: torch.Tensor,
    n_kv: int,
    mask: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> Callable | None:
    g, t, h, d = q.shape
    if (
        t > ATTN_MAX_ROWS
        or k.ggml_type not in (T.F32, T.F16)
        or v.ggml_type not in (T.F32, T.F16)
        or not _f32(q, out)
        or mask.dtype != torch.float16
        or not mask.is_contiguous()
    ):
        return None
    return CCall(
        "attention",
        lib.ub_attn,
        (
            q.data_ptr(),
            g,
            t,
            h,
            d,
            k.data.data_ptr(),
            int(k.ggml_type == T.F16),
            v.data.data_ptr(),
            int(v.ggml_type == T.F16),
            k.n_head,
            v.head_dim,
            starts.data_ptr(),
            n_kv,
            mask.data_ptr(),
            scale,
            out.data_ptr(),
            nth,
        ),
    )
