"""The fast CPU backend: matmuls and the embedding lookup read the GGUF blocks directly.

Few rows (decode, up to GEMV_MAX_ROWS): the C matrix-vector kernel streams each weight row
once for every activation row, dequantising in registers (on AVX2 it reads x reordered into
planned scratch, `gemv_scratch`). More rows (prefill): on AVX2 the C
GEMM dequantises weight panels into per-thread planned scratch as it consumes them
(kernels/csrc/gemm.c); on a CPU with AMX, from AMX_MIN_ROWS rows, the same on AMX tiles with
f32 values split into three bf16 parts (kernels/csrc/amx.c, as accurate); elsewhere tiles of
the weight are dequantised into planned scratch for the BLAS GEMM. No dense copy of any matrix
outlives the call. Norms, RoPE, the gated activation, residual adds, KV writes and
decode-shaped attention are C calls too, bound once per graph (kernels/cpu_bind.py); anything
else is the torch reference's code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from gguf import GGMLQuantizationType as T

from ubatch.kernels.cpu.bind import AMX_MIN_ROWS, ATTN_MAX_ROWS, GEMV_MAX_ROWS, KERNEL_TYPES, bind_node, tile_rows
from ubatch.kernels.cpu.build import CpuLibrary, load
from ubatch.kernels.cpu.program import fuse
from ubatch.kernels.ops import KV_CHUNK, KVTensor, ScratchSpec, attn_scratch
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.repack import Repacks
from ubatch.kernels.quant.weight import QWeight
from ubatch.kernels.torch_ops import TorchOps


def _rows_ok(*ts: torch.Tensor) -> bool:
    """f32 (b, rows, cols) tensors whose rows are contiguous and packed (the C tile products)."""
    return all(t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in ts)


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(
        self, n_threads: int = 1, portable: bool | None = None, no_avx512: bool = False, no_amx: bool = False
    ) -> None:
        super().__init__(n_threads)
        self.library: CpuLibrary = load(portable, no_avx512)
        self._lib = self.library.lib
        self.n_threads = max(1, n_threads)
        self.name = "cpu-portable" if portable else "cpu-avx2" if no_avx512 else "cpu-noamx" if no_amx else "cpu"
        if self.library.notice:
            self.notices.append(self.library.notice)
        self._noticed: set[int] = set()
        self._chunk_need: dict[tuple[int, int, int], int] = {}  # fused attention's scratch by shape
        # the register-blocked GEMM (kernels/csrc/gemm.c; 512-bit where the CPU has AVX-512F):
        # measured above MKL's f32 GEMM on Zen 3 (107-125 against 78-121 GFLOP/s) and on Zen 5
        # (383-413 against 176-185); the portable build has none
        self.has_gemm = self.library.simd != "portable"
        self.gemm_scratch = int(self._lib.ub_gemm_scratch(self.n_threads))  # floats, per call
        # AMX tiles for prefill's GEMM where the library has them (cpu_build); `cpu-noamx` keeps the
        # f32 FMA kernel for comparison
        self.amx = self.library.amx and not no_amx
        self.repacks = Repacks(self.library.simd == "avx2")  # Q5_0 as Q8_0 for the AVX2 GEMV

    def amx_scratch(self, m: int) -> int:
        """Floats of scratch the AMX GEMM needs for m rows (0: an m-row product skips the tiles):
        x split into tiles, per-thread panels. The plan and the binding both ask here."""
        return int(self._lib.ub_gemm_amx_scratch(m, self.n_threads)) if self.amx and m >= AMX_MIN_ROWS else 0

    def gemv_scratch(self, m: int, w: QWeight) -> int:
        """Floats of scratch the fused GEMV needs for m rows (the plan and the binding ask here)."""
        return int(self._lib.ub_gemv_scratch(self.repacks.kernel_type(w), m, w.shape[1]))

    # -- weights --------------------------------------------------------------------------------
    def prepare_weights(self, weights: list[QWeight]) -> None:
        """The kernels read the memory-mapped blocks as stored, but Q5_0 on AVX2 (kernels/repack.py)."""
        self.repacks.plan(weights)
        for w in weights:
            if w.ggml_type not in KERNEL_TYPES and w.ggml_type not in self._noticed:
                self._noticed.add(w.ggml_type)
                self.notices.append(
                    f"{T(w.ggml_type).name} has no CPU kernel: those tensors are dequantised at each use (slower)"
                )

    def held_bytes(self) -> int:
        return self.repacks.held_bytes()

    def kernel_path(self, ggml_type: int) -> str:
        if ggml_type not in KERNEL_TYPES:
            return "dequantise per use + BLAS"
        gemv = f"{self.repacks.describe(ggml_type)}C {self.library.simd}: fused dequant GEMV (<= {GEMV_MAX_ROWS} rows)"
        if ggml_type == T.F32:
            return f"{gemv}, BLAS GEMM (more rows)"
        if self.has_gemm:
            tiles = f"; AMX tiles from {AMX_MIN_ROWS} rows, f32 values as three bf16 parts" if self.amx else ""
            return f"{gemv}, register-blocked GEMM dequantising weight panels (more rows{tiles})"
        return f"{gemv}, dequantised tiles + BLAS GEMM (more rows)"

    def linear_scratch(self, m: int, w: QWeight) -> ScratchSpec:
        if m <= GEMV_MAX_ROWS:  # x reordered for the AVX2 decoders, its 32-value sums
            n = self.gemv_scratch(m, w) if w.ggml_type in KERNEL_TYPES else 0
            return [((n,), torch.float32)] if n else []
        if w.ggml_type == T.F32 or w.ggml_type not in KERNEL_TYPES:
            return []
        if self.amx_scratch(m):  # x split into tiles, and a block of weight tiles a thread
            return [((self.amx_scratch(m),), torch.float32)]
        if self.has_gemm:  # per thread: one block of weight panels, dequantised as the GEMM reads them
            return [((self.gemm_scratch,), torch.float32)]
        return [((tile_rows(m, w.shape[0]), w.shape[1]), torch.float32)]

    # -- binding: the graph executor asks once per node ------------------------------------------
    def bind(
        self, op: str, args: list, out: torch.Tensor | None, scratch: list[torch.Tensor]
    ) -> Callable[[], Any] | None:
        return bind_node(self, op, args, out, scratch)

    def fuse(self, steps: list[Callable[[], Any]]) -> list[Callable[[], Any]]:
        """A bound graph's consecutive C calls as single calls (kernels/cpu_program.py)."""
        return fuse(self._lib, steps)

    def _c(self, op: str, args: list, out: torch.Tensor | None, scratch: list[torch.Tensor]) -> bool:
        f = bind_node(self, op, args, out, scratch)
        if f is None:
            return False
        f()
        return True

    # -- ops (a direct call binds and runs; what C does not cover falls back to torch) ---------
    def get_rows(self, w: QWeight, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        w = self.repacks.layout(w)
        if w.ggml_type not in KERNEL_TYPES:
            return out.copy_(w.rows(ids))
        if not self._c("get_rows", [w, ids.long().contiguous()], out, []):
            raise AssertionError("get_rows: unsupported layout")
        return out

    def linear(
        self, x: torch.Tensor, w: QWeight, out: torch.Tensor, scratch: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        m, (n, k), w = x.shape[0], w.shape, self.repacks.layout(w)
        if m == 0:
            return out
        if w.ggml_type not in KERNEL_TYPES:
            return torch.mm(x, dequantize(w.raw, w.ggml_type, w.shape).t(), out=out)
        if x.stride(1) != 1 or x.stride(0) < k:
            x = x.contiguous()
        if (m <= GEMV_MAX_ROWS or self.has_gemm) and self._c("linear", [x, w], out, scratch or []):
            return out
        if w.ggml_type == T.F32:
            return torch.mm(x, w.raw.view(torch.float32).view(n, k).t(), out=out)
        planned = scratch[0] if scratch and scratch[0].dim() == 2 and scratch[0].shape[1] == k else None
        tile = planned if planned is not None else torch.empty(tile_rows(m, n), k)
        rows = tile.shape[0]
        if rows >= n:
            self._dequant(w, 0, n, tile)
            return torch.mm(x, tile[:n].t(), out=out)
        out_t = out.t()  # column-major view: each tile's product lands in its columns, no copy
        for n0 in range(0, n, rows):
            r = min(rows, n - n0)
            self._dequant(w, n0, r, tile)
            torch.mm(tile[:r], x.t(), out=out_t[n0 : n0 + r])
        return out

    def rms_norm(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor, scratch: list[torch.Tensor]
    ) -> torch.Tensor:
        if not self._c("rms_norm", [x, w, eps], out, scratch):
            super().rms_norm(x, w, eps, out, scratch)
        return out

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool, out: torch.Tensor
    ) -> torch.Tensor:
        if not self._c("rope", [x, cos.contiguous(), sin.contiguous(), neox], out, []):
            super().rope(x, cos, sin, neox, out)
        return out

    def glu(self, gate: torch.Tensor, up: torch.Tensor, act: str, out: torch.Tensor) -> torch.Tensor:
        if not self._c("glu", [gate, up, act], out, []):
            super().glu(gate, up, act, out)
        return out

    def kv_store(
        self, kv: KVTensor, cells: torch.Tensor, x: torch.Tensor, scratch: list[torch.Tensor] | None = None
    ) -> None:
        if not self._c("kv_store", [kv, cells.long().contiguous(), x.contiguous()], None, []):
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
    ) -> torch.Tensor:
        """Decode-shaped attention (few rows per group) reads the f16/f32 cells in one C pass;
        prefill keeps the reference's chunked GEMMs, which reuse each K/V chunk for all rows."""
        args = [q, k, v, starts, n_kv, mask, scale, visible]
        if not self._c("attention", args, out, scratch):
            super().attention(q, k, v, starts, n_kv, mask, scale, out, scratch, visible)
        return out

    def attention_scratch(
        self, g: int, t: int, h: int, n_head_kv: int, n_kv: int, d: int, dv: int, type_k: int, type_v: int
    ) -> ScratchSpec:
        """The reference's tiles, plus for prefill (more rows than the C decode path reads) the
        fused chunk's packed K and V and its per-thread score blocks (kernels/csrc/flash.c)."""
        out = attn_scratch(g, t, h, n_head_kv, n_kv, d, dv)
        if self.has_gemm and t > ATTN_MAX_ROWS:
            c = min(KV_CHUNK, n_kv)
            out.append(((int(self._lib.ub_attn_chunk_scratch(c, d, dv, self.n_threads)),), torch.float32))
        return out

    def chunk_attention(
        self,
        qh: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        c0: int,
        scale: float,
        m: torch.Tensor,
        rowsum: torch.Tensor,
        acc: torch.Tensor,
        scratch: list[torch.Tensor],
        r: int,
    ) -> None:
        """One C call per chunk: each thread takes blocks of query rows through Q·Kᵀ, the softmax
        step and P·V, skipping the cells none of a block's rows sees (1.08x the causal triangle's
        scores at 512 tokens, against 1.25x for the reference's tiles)."""
        b, rows, d = qh.shape
        c, dv = k.shape[1], v.shape[2]
        need = self._chunk_need.get((c, d, dv)) if self.has_gemm else 0
        if need is None:  # asked once per shape: a ctypes call per chunk and layer costs ~1 us
            need = self._chunk_need[c, d, dv] = int(self._lib.ub_attn_chunk_scratch(c, d, dv, self.n_threads))
        if not (
            need
            and len(scratch) > 2
            and scratch[2].numel() >= need
            and _rows_ok(qh, k, v, acc)
            and mask.dtype == torch.float16
            and mask.stride(2) == 1
            and mask.device.type == "cpu"
            and m.stride() == rowsum.stride()
            and m.stride(1) == 1
        ):
            return super().chunk_attention(qh, k, v, mask, c0, scale, m, rowsum, acc, scratch, r)
        grid = (mask[:, :, c0:].data_ptr(), b // mask.shape[0], r, mask.stride(0), mask.stride(1), scale)
        state = (m.data_ptr(), rowsum.data_ptr(), m.stride(0), acc.data_ptr(), acc.stride(0))
        self._lib.ub_attn_chunk(
            qh.data_ptr(), qh.stride(0), b, rows, d, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), c, dv,
            *grid, *state, scratch[2].data_ptr(), self.n_threads,
        )  # fmt: skip

    def visible_span(self, mask: torch.Tensor, t0: int, tb: int, c0: int, c: int) -> tuple[int, int]:
        """Read from the f16 mask in C: under a causal mask a 512-token prefill's tiles shrink to
        62.5% of their area (hidden cells would only add exp(-inf) = 0)."""
        if mask.dtype != torch.float16 or mask.stride(2) != 1 or mask.device.type != "cpu":
            return 0, c
        tile = mask[:, t0 : t0 + tb, c0 : c0 + c]
        v = self._lib.ub_mask_span(tile.data_ptr(), tile.shape[0], tb, c, tile.stride(0), tile.stride(1))
        return v & 0xFFFFFFFF, v >> 32

    def softmax_tile(
        self,
        s: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
        m: torch.Tensor,
        rowsum: torch.Tensor,
        acc: torch.Tensor,
        tmp: torch.Tensor,
        r: int,
    ) -> None:
        """The tile's ten torch passes as one C call of two passes (kernels/csrc/attention.c)."""
        b, rows, c = s.shape
        if not (
            s.is_contiguous()
            and mask.dtype == torch.float16
            and mask.stride(2) == 1
            and m.stride() == rowsum.stride()
            and m.stride(1) == 1
            and acc.stride(2) == 1
            and acc.stride(1) == acc.shape[2]
        ):
            return super().softmax_tile(s, mask, scale, m, rowsum, acc, tmp, r)
        grid = (b, rows, c, mask.data_ptr(), b // mask.shape[0], r, mask.stride(0), mask.stride(1), scale)
        state = (m.data_ptr(), rowsum.data_ptr(), m.stride(0), acc.data_ptr(), acc.stride(0), acc.shape[2])
        self._lib.ub_softmax_tile(s.data_ptr(), *grid, *state, self.n_threads)

    def _dequant(self, w: QWeight, r0: int, n: int, tile: torch.Tensor) -> None:
        self._lib.ub_dequant_rows(
            w.ggml_type, w.raw.data_ptr(), w.row_bytes, r0, n, w.shape[1], tile.data_ptr(), self.n_threads
        )
