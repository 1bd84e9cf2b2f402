"""The fast CPU backend: matmuls and the embedding lookup read the GGUF blocks directly.

Few rows (decode, up to GEMV_MAX_ROWS): the C matrix-vector kernel streams each weight row
once for every activation row, decoding in registers (the AVX2 build multiplies a block type's
integer codes with x rounded to 16-bit integers in planned scratch, `gemv_scratch`;
csrc/quant_i16.h). More rows (prefill): the C GEMM decodes weight panels into per-thread
planned scratch as it consumes them (csrc/gemm.c: f32 panels with AVX-512, 16-bit codes with
AVX2); on a CPU with AMX, from AMX_MIN_ROWS rows, the same on AMX tiles with
f32 values split into three bf16 parts (csrc/amx.c, as accurate); elsewhere tiles of
the weight are dequantised into planned scratch for the BLAS GEMM. No dense copy of any matrix
outlives the call. Norms, RoPE, the gated activation, residual adds, KV writes and
decode-shaped attention are C calls too, bound once per graph (kernels/cpu/bind.py); prefill's
attention is the reference's chunk loop with its tiles computed in C (`CpuTiles`). Anything
else is the torch reference's code, called explicitly (`self.ref`).
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
from collections.abc import Sequence

import torch
from gguf import GGMLQuantizationType as T
from torch import Tensor

from ubatch.kernels.cpu.bind import (
    AMX_MIN_ROWS,
    ATTN_MAX_ROWS,
    GEMV_MAX_ROWS,
    IQ_TYPES,
    KERNEL_TYPES,
    CpuKernels,
    tile_rows,
)
from ubatch.kernels.cpu.build import load
from ubatch.kernels.cpu.dispatch import BuildChoice, choose_build
from ubatch.kernels.cpu.program import fuse
from ubatch.kernels.ops import (
    KV_CHUNK,
    AttentionArgs,
    KVTensor,
    LoraArgs,
    MoeTopKArgs,
    MoeWeightsArgs,
    MulMatIdArgs,
    NodeArgs,
    Ops,
    ScratchSpec,
    Step,
)
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.weight import QWeight
from ubatch.kernels.torch_ops import AttentionTiles, OnlineSoftmax, TorchOps


def _rows_ok(*ts: Tensor) -> bool:
    """f32 (b, rows, cols) tensors whose rows are contiguous and packed (the C tile products)."""
    return all(t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in ts)


def _f16_mask(mask: Tensor) -> bool:
    """A mask tile the C kernels read: f16 in host memory, cells contiguous."""
    return mask.dtype == torch.float16 and mask.stride(2) == 1 and mask.device.type == "cpu"


def _run(call: Step | None) -> bool:
    """A direct call of an op: its C call run, or False where the kernels do not cover it."""
    if call is None:
        return False
    call()
    return True


def _state_ok(state: OnlineSoftmax) -> bool:
    """The running max and sum share one layout with unit row stride (the C kernels' view)."""
    return state.m.stride() == state.rowsum.stride() and state.m.stride(1) == 1


class CpuTiles(AttentionTiles):
    """Prefill attention's steps in C: a chunk's blocks of query rows in one call where the
    build has the fused kernel, else the reference's tiles with the softmax step and the
    visible span in C (csrc/attention.c, csrc/flash.c)."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self._chunk_need: dict[tuple[int, int, int], int] = {}  # fused attention's scratch by shape

    def chunk_scratch(self, c: int, d: int, dv: int) -> int:
        """Floats of the fused chunk's scratch (packed K and V, per-thread score blocks); asked
        once per shape: a ctypes call per chunk and layer costs ~1 us."""
        need = self._chunk_need.get((c, d, dv))
        if need is None:
            need = self._chunk_need[c, d, dv] = int(
                self.kernels.lib.ub_attn_chunk_scratch(c, d, dv, self.kernels.n_threads)
            )
        return need

    def chunk_attention(
        self, qh: Tensor, k: Tensor, v: Tensor, mask: Tensor, c0: int, state: OnlineSoftmax, scratch: list[Tensor]
    ) -> None:
        """One C call per chunk: each thread takes blocks of query rows through Q·Kᵀ, the softmax
        step and P·V, skipping the cells none of a block's rows sees (1.08x the causal triangle's
        scores at 512 tokens, against 1.25x for the reference's tiles)."""
        b, rows, d = qh.shape
        c, dv = k.shape[1], v.shape[2]
        need = self.chunk_scratch(c, d, dv) if self.kernels.has_gemm else 0
        m, rowsum, acc = state.m, state.rowsum, state.acc
        if not (
            need
            and len(scratch) > 1
            and scratch[1].numel() >= need
            and _rows_ok(qh, k, v, acc)
            and _f16_mask(mask)
            and _state_ok(state)
        ):
            return super().chunk_attention(qh, k, v, mask, c0, state, scratch)
        grid = (mask[:, :, c0:].data_ptr(), b // mask.shape[0], state.r, mask.stride(0), mask.stride(1))
        scales = (state.scale, state.softcap)
        tail = (m.data_ptr(), rowsum.data_ptr(), m.stride(0), acc.data_ptr(), acc.stride(0))
        self.kernels.lib.ub_attn_chunk(
            qh.data_ptr(), qh.stride(0), b, rows, d, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), c, dv,
            *grid, *scales, *tail, scratch[1].data_ptr(), self.kernels.n_threads,
        )  # fmt: skip

    def visible_span(self, mask: Tensor, t0: int, tb: int, c0: int, c: int) -> tuple[int, int]:
        """Read from the f16 mask in C: under a causal mask a 512-token prefill's tiles shrink to
        62.5% of their area (hidden cells would only add exp(-inf) = 0)."""
        if not _f16_mask(mask):
            return 0, c
        tile = mask[:, t0 : t0 + tb, c0 : c0 + c]
        v = int(self.kernels.lib.ub_mask_span(tile.data_ptr(), tile.shape[0], tb, c, tile.stride(0), tile.stride(1)))
        return v & 0xFFFFFFFF, v >> 32

    def softmax_tile(self, s: Tensor, mask: Tensor, state: OnlineSoftmax) -> None:
        """The tile's ten torch passes as one C call of two passes (csrc/attention.c)."""
        b, rows, c = s.shape
        m, rowsum, acc = state.m, state.rowsum, state.acc
        if not (
            s.is_contiguous()
            and mask.dtype == torch.float16
            and mask.stride(2) == 1
            and _state_ok(state)
            and acc.stride(2) == 1
            and acc.stride(1) == acc.shape[2]
        ):
            return super().softmax_tile(s, mask, state)
        grid = (b, rows, c, mask.data_ptr(), b // mask.shape[0], state.r, mask.stride(0), mask.stride(1))
        scales = (state.scale, state.softcap)
        tail = (m.data_ptr(), rowsum.data_ptr(), m.stride(0), acc.data_ptr(), acc.stride(0), acc.shape[2])
        self.kernels.lib.ub_softmax_tile(s.data_ptr(), *grid, *scales, *tail, self.kernels.n_threads)


def _tokens(a: NodeArgs[Tensor]) -> int:
    """The tokens of the graph a node belongs to, as its first tensor's rows (attention's q is
    (groups, tokens, heads, d)): which build's kernels bind it (CpuOps._kn)."""
    if isinstance(a, AttentionArgs):
        return a.q.shape[0] * a.q.shape[1]
    for f in dataclasses.fields(a):
        v = getattr(a, f.name)
        if isinstance(v, Tensor):
            return v.shape[0] if v.dim() else 1
    return 1


class CpuOps(Ops):
    name = "cpu"

    def __init__(
        self,
        n_threads: int = 1,
        portable: bool | None = None,
        no_avx512: bool = False,
        no_amx: bool = False,
        measured: bool = False,
    ) -> None:
        """`measured`: on an AVX-512 CPU, decode's and prefill's kernels each come from the build
        measured faster for them (kernels/cpu/dispatch.py); otherwise the one build asked for."""
        self.kernels = CpuKernels(load(portable, no_avx512), n_threads, no_amx)  # decode's (<= GEMV_MAX_ROWS tokens)
        self.prefill_kernels = self.kernels  # graphs of more tokens
        self.choice: BuildChoice | None = None
        if measured and not portable and not no_avx512 and self.kernels.library.simd == "avx512":
            self.choice = choose_build()
            avx2 = (
                CpuKernels(load(no_avx512=True), n_threads, no_amx)
                if "avx2" in (self.choice.decode, self.choice.prefill)
                else None
            )
            if avx2 is not None and self.choice.decode == "avx2":
                self.kernels = avx2
            if avx2 is not None and self.choice.prefill == "avx2":
                self.prefill_kernels = avx2
            if self.prefill_kernels is not self.kernels:
                # one layout of each weight, decode's (the AVX2 GEMV's Q5_0 repack is Q8_0, which
                # every GEMM reads): prefill never faults back the file pages a repack released
                self.prefill_kernels = copy.copy(self.prefill_kernels)
                self.prefill_kernels.repacks = self.kernels.repacks
        self.n_threads = self.kernels.n_threads
        self.tiles = CpuTiles(self.prefill_kernels)
        self.ref = TorchOps(self.n_threads, tiles=self.tiles)  # the ops and layouts C does not cover
        self.name = "cpu-portable" if portable else "cpu-avx2" if no_avx512 else "cpu-noamx" if no_amx else "cpu"
        self.notices = [self.kernels.library.notice] if self.kernels.library.notice else []
        self.dispatch = self.choice.lines() if self.choice is not None else ()
        self._noticed: set[int] = set()

    def _libraries(self) -> list[CpuKernels]:
        """One CpuKernels per distinct library (the two phases may share one build)."""
        return [self.kernels] if self.prefill_kernels.lib is self.kernels.lib else [self.kernels, self.prefill_kernels]

    def _kn(self, rows: int) -> CpuKernels:
        """The kernels of a graph of `rows` tokens: decode's or prefill's build."""
        return self.kernels if rows <= GEMV_MAX_ROWS else self.prefill_kernels

    def fallback(self) -> Ops:
        return self.ref

    def argmax_rows(self, logits: Tensor) -> list[int]:
        """In C (csrc/rowops.c), the threads splitting a row as the output GEMV did: a 262144-wide
        row after a step in 37-40 us where numpy's one-thread pass took 42-46."""
        n = logits.shape[0]
        if not (n and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1):
            return super().argmax_rows(logits)
        out = (ctypes.c_int32 * n)()
        self.kernels.lib.ub_argmax_rows(logits.data_ptr(), n, logits.shape[1], logits.stride(0), out, self.n_threads)
        return list(out)

    # -- weights --------------------------------------------------------------------------------
    def prepare_weights(self, weights: list[QWeight]) -> None:
        """The kernels read the memory-mapped blocks as stored, but Q5_0 on AVX2 (quant/repack.py)."""
        self.kernels.repacks.plan(weights)  # the phases share decode's layouts
        for w in weights:
            if w.ggml_type not in KERNEL_TYPES and w.ggml_type not in self._noticed:
                self._noticed.add(w.ggml_type)
                self.notices.append(
                    f"{T(w.ggml_type).name} has no CPU kernel: those tensors are dequantised at each use (slower)"
                )

    def held_bytes(self) -> int:
        return self.kernels.repacks.held_bytes()

    def extra_read_bytes(self) -> int:
        return self.kernels.repacks.extra_bytes()

    def kernel_path(self, ggml_type: int) -> str:
        if ggml_type not in KERNEL_TYPES:
            return "dequantise per use + BLAS"
        kd, kp = self.kernels, self.prefill_kernels
        simd = kd.library.simd
        gemv = f"{kd.repacks.describe(ggml_type)}C {simd}: fused dequant GEMV (<= {GEMV_MAX_ROWS} rows)"
        if kd.vnni and ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K):  # csrc/gemv_vnni.c
            dot = "vpdpwssd" if kd.vnni == 2 else "vpmaddwd"
            gemv = f"C {simd}: integer GEMV, x as 16-bit integers per 256 values, {dot} (<= {GEMV_MAX_ROWS} rows)"
        if ggml_type == T.F32:
            return f"{gemv}, BLAS GEMM (more rows)"
        build = f"C {kp.library.simd}: " if kp is not kd else ""  # prefill on the other build
        if kp.has_gemm:
            tiles = f"; AMX tiles from {AMX_MIN_ROWS} rows, f32 values as three bf16 parts" if kp.amx else ""
            if kp.vnni and ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K):  # csrc/gemv_vnni.c
                dots = "vpdpwssd + vpdpbusd" if kp.vnni == 2 else "vpmaddwd + vpmaddubsw"
                return (
                    f"{gemv}, {build}register-blocked GEMM on code panels, x as 16 + 8-bit integers, {dots} "
                    f"(more rows{tiles})"
                )
            if kp.x16 and ggml_type not in (T.F16, T.BF16, *IQ_TYPES):  # block types: csrc/quant_i16.h
                return f"{gemv}, {build}register-blocked GEMM on 16-bit code panels (more rows); x as 16-bit integers"
            return f"{gemv}, {build}register-blocked GEMM dequantising weight panels (more rows{tiles})"
        return f"{gemv}, dequantised tiles + BLAS GEMM (more rows)"

    def linear_scratch(self, m: int, w: QWeight) -> ScratchSpec:
        kn = self._kn(m)
        if m <= GEMV_MAX_ROWS:  # x reordered for the AVX2 decoders, its 32-value sums
            n = kn.gemv_scratch(m, w) if w.ggml_type in KERNEL_TYPES else 0
            return [((n,), torch.float32)] if n else []
        if w.ggml_type == T.F32 or w.ggml_type not in KERNEL_TYPES:
            return []
        if kn.amx_scratch(m):  # x split into tiles, and a block of weight tiles a thread
            return [((kn.amx_scratch(m),), torch.float32)]
        if kn.has_gemm:  # per thread: one block of weight panels, dequantised as the GEMM reads them
            return [((kn.gemm_scratch(m, w),), torch.float32)]
        return [((tile_rows(m, w.shape[0]), w.shape[1]), torch.float32)]

    def mul_mat_id_scratch(self, n: int, k: int, w: QWeight) -> ScratchSpec:
        """An expert's gathered rows, their products and its GEMV's or GEMM's scratch (csrc/moe.c)."""
        if w.ggml_type not in KERNEL_TYPES:
            return []
        return [((self._kn(n).mul_mat_id_scratch(n, k, w),), torch.float32)]

    def attention_scratch(self, q: tuple[int, ...], k: KVTensor, v: KVTensor, n_kv: int) -> ScratchSpec:
        """The reference's tiles, plus for prefill (more rows than the C decode path reads) the
        fused chunk's packed K and V and its per-thread score blocks (csrc/flash.c)."""
        out = super().attention_scratch(q, k, v, n_kv)
        if self.prefill_kernels.has_gemm and q[1] > ATTN_MAX_ROWS:
            out.append(((self.tiles.chunk_scratch(min(KV_CHUNK, n_kv), q[3], v.head_dim),), torch.float32))
        return out

    # -- binding: the graph executor asks once per node ------------------------------------------
    def bind(self, a: NodeArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Step:
        f = (self.kernels if self.prefill_kernels is self.kernels else self._kn(_tokens(a))).bind(a, out, scratch)
        return f if f is not None else super().bind(a, out, scratch)

    def fuse(self, steps: Sequence[Step]) -> list[Step]:
        """A bound graph's consecutive C calls as single calls (kernels/cpu/program.py)."""
        return fuse([kn.lib for kn in self._libraries()], steps)

    # -- ops (a direct call binds and runs; what C does not cover is the reference's) ----------
    def get_rows(self, w: QWeight, ids: Tensor, out: Tensor) -> Tensor:
        w = self.kernels.repacks.layout(w)
        if w.ggml_type not in KERNEL_TYPES:
            return out.copy_(w.rows(ids))
        if not _run(self.kernels.get_rows(w, ids.long().contiguous(), out)):
            raise AssertionError("get_rows: unsupported layout")
        return out

    def linear(self, x: Tensor, w: QWeight, out: Tensor, scratch: list[Tensor] | None = None) -> Tensor:
        kn = self._kn(x.shape[0])
        m, (n, k), w = x.shape[0], w.shape, kn.repacks.layout(w)
        if m == 0:
            return out
        if w.ggml_type not in KERNEL_TYPES:
            return torch.mm(x, dequantize(w.raw, w.ggml_type, w.shape).t(), out=out)
        if x.stride(1) != 1 or x.stride(0) < k:
            x = x.contiguous()
        if (m <= GEMV_MAX_ROWS or kn.has_gemm) and _run(kn.linear(x, w, out, scratch or [])):
            return out
        if w.ggml_type == T.F32:
            return torch.mm(x, w.raw.view(torch.float32).view(n, k).t(), out=out)
        planned = scratch[0] if scratch and scratch[0].dim() == 2 and scratch[0].shape[1] == k else None
        tile = planned if planned is not None else torch.empty(tile_rows(m, n), k)
        rows = tile.shape[0]
        if rows >= n:
            kn.dequant_rows(w, 0, n, tile)
            return torch.mm(x, tile[:n].t(), out=out)
        out_t = out.t()  # column-major view: each tile's product lands in its columns, no copy
        for n0 in range(0, n, rows):
            r = min(rows, n - n0)
            kn.dequant_rows(w, n0, r, tile)
            torch.mm(tile[:r], x.t(), out=out_t[n0 : n0 + r])
        return out

    def mul_mat_id(self, a: MulMatIdArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        if not _run(self._kn(a.ids.shape[0]).mul_mat_id(a, out, scratch)):
            self.ref.mul_mat_id(a, out, scratch)
        return out

    def lora(self, a: LoraArgs[Tensor], out: Tensor) -> Tensor:
        if not _run(self._kn(a.x.shape[0]).lora(a, out)):
            self.ref.lora(a, out)
        return out

    def moe_topk(self, a: MoeTopKArgs[Tensor], out: Tensor) -> Tensor:
        if not _run(self._kn(a.logits.shape[0]).moe_topk(a, out)):
            self.ref.moe_topk(a, out)
        return out

    def moe_weights(self, a: MoeWeightsArgs[Tensor], out: Tensor) -> Tensor:
        if not _run(self._kn(a.logits.shape[0]).moe_weights(a, out)):
            self.ref.moe_weights(a, out)
        return out

    def rms_norm(self, x: Tensor, w: Tensor, eps: float, out: Tensor, scratch: list[Tensor]) -> Tensor:
        if not _run(self._kn(x.shape[0]).rms_norm(x, w, eps, out)):
            self.ref.rms_norm(x, w, eps, out, scratch)
        return out

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, neox: bool, out: Tensor) -> Tensor:
        if not _run(self._kn(x.shape[0]).rope(x, cos.contiguous(), sin.contiguous(), neox, out)):
            self.ref.rope(x, cos, sin, neox, out)
        return out

    def glu(self, gate: Tensor, up: Tensor, act: str, out: Tensor) -> Tensor:
        if not _run(self._kn(gate.shape[0]).glu(gate, up, act, out)):
            self.ref.glu(gate, up, act, out)
        return out

    def scale(self, x: Tensor, s: float, out: Tensor) -> Tensor:
        return self.ref.scale(x, s, out)

    def add(self, a: Tensor, b: Tensor, out: Tensor) -> Tensor:
        return self.ref.add(a, b, out)

    def rows(self, x: Tensor, idx: Tensor, out: Tensor) -> Tensor:
        return self.ref.rows(x, idx, out)

    def softcap(self, x: Tensor, c: float, out: Tensor) -> Tensor:
        if not _run(self._kn(x.shape[0]).softcap(x, c, out)):
            self.ref.softcap(x, c, out)
        return out

    def add_bias(self, x: Tensor, b: Tensor, out: Tensor) -> Tensor:
        if not _run(self._kn(x.shape[0]).add_bias(x, b, out)):
            self.ref.add_bias(x, b, out)
        return out

    def kv_store(self, kv: KVTensor, cells: Tensor, x: Tensor, scratch: list[Tensor] | None = None) -> None:
        if not _run(self._kn(x.shape[0]).kv_store(kv, cells.long().contiguous(), x.contiguous())):
            self.ref.kv_store(kv, cells, x, scratch)

    def kv_rows(self, kv: KVTensor, cells: Tensor) -> Tensor:
        return self.ref.kv_rows(kv, cells)

    def attention(self, a: AttentionArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        """Decode-shaped attention (few rows per group) reads the f16/f32 cells in one C pass;
        prefill keeps the reference's chunk loop, which reuses each K/V chunk for all rows, with
        its tiles in C (`CpuTiles`)."""
        if not _run(self._kn(_tokens(a)).attention(a, out)):
            self.ref.attention(a, out, scratch)
        return out

    def rope_cache(
        self, pos: Tensor, n_rot: int, base: float, scale: float, freq_factors: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.ref.rope_cache(pos, n_rot, base, scale, freq_factors)
