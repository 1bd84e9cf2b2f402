"""The torch reference backend: plain torch ops on any device, weights dequantised once to f32.

It is the yardstick every other backend is tested against (tests/test_backends.py) and the
fallback when no faster backend can run. Its dense copies are the only memory a backend holds
beyond the file's tensor bytes, and `held_bytes` says so.
"""

from __future__ import annotations

import math

import torch

from ubatch.kernels.ops import KV_CHUNK, MASKED, TRIM_MIN_TOKENS, KVTensor, ScratchSpec, attn_scratch_count, query_block
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.quantize import QUANTIZERS
from ubatch.kernels.quant.weight import QWeight


class TorchOps:
    """Reference implementation: plain torch on any device, weights dequantised once to f32."""

    name = "torch"
    mask_in_kernel = False  # attention reads the engine's [n_tokens, n_kv] mask tensor

    def __init__(self, n_threads: int = 1, compute_dtype: torch.dtype = torch.float32) -> None:
        self.compute_dtype = compute_dtype
        self.n_threads = n_threads
        self.notices: list[str] = []
        self._rope_tables: dict[tuple, tuple] = {}  # key -> (inverse frequencies, cos, sin)
        self._weights: list[QWeight] = []
        self._dense: dict[QWeight, torch.Tensor] = {}

    # -- weights --------------------------------------------------------------------------------
    def prepare_weights(self, weights: list[QWeight]) -> None:
        """The reference multiplies dense copies, each made at its first use: a context that is
        only planned (`ubatch info`, `--fit`) dequantises nothing."""
        self._weights += [w for w in weights if w not in self._weights]

    def dense(self, w: QWeight) -> torch.Tensor:
        t = self._dense.get(w)
        if t is None:
            t = self._dense[w] = dequantize(w.raw, w.ggml_type, w.shape, self.compute_dtype)
        return t

    def held_bytes(self) -> int:
        """The dense copies of the prepared weights, made or still to be made."""
        return sum(math.prod(w.shape) for w in self._weights) * self.compute_dtype.itemsize

    def kernel_path(self, ggml_type: int) -> str:
        return f"torch: dense {str(self.compute_dtype).removeprefix('torch.')} copy + torch.mm"

    def linear_scratch(self, m: int, w: QWeight) -> ScratchSpec:
        return []

    # -- ops ------------------------------------------------------------------------------------
    def get_rows(self, w: QWeight, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.dense(w), 0, ids, out=out)

    def linear(
        self, x: torch.Tensor, w: QWeight, out: torch.Tensor, scratch: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        return torch.mm(x, self.dense(w).t(), out=out)

    def rms_norm(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor, scratch: list[torch.Tensor]
    ) -> torch.Tensor:
        """x / sqrt(mean(x²) + eps) * w, over the last dim; scratch[0] holds one value per row."""
        r = scratch[0]
        torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True, out=r)
        r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        torch.mul(x, r, out=out)
        return out.mul_(w)

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool, out: torch.Tensor
    ) -> torch.Tensor:
        """x (n, heads, d): rotate the first 2·cos.shape[1] dims; NEOX pairs (i, i + half)."""
        half = cos.shape[1]
        c, s = cos[:, None, :], sin[:, None, :]
        if neox:
            a, b, oa, ob = x[..., :half], x[..., half : 2 * half], out[..., :half], out[..., half : 2 * half]
        else:
            a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
            oa, ob = out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2]
        torch.mul(a, c, out=oa).addcmul_(b, s, value=-1.0)
        torch.mul(a, s, out=ob).addcmul_(b, c)
        if 2 * half < x.shape[-1]:
            out[..., 2 * half :].copy_(x[..., 2 * half :])
        return out

    def scale(self, x: torch.Tensor, s: float, out: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, s, out=out)

    def add(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.add(a, b, out=out)

    def glu(self, gate: torch.Tensor, up: torch.Tensor, act: str, out: torch.Tensor) -> torch.Tensor:
        if act == "gelu_tanh":
            torch.ops.aten.gelu.out(gate, approximate="tanh", out=out)
        else:
            torch.ops.aten.silu.out(gate, out=out)
        return out.mul_(up)

    def rows(self, x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.index_select(x, 0, idx, out=out)

    def softcap(self, x: torch.Tensor, c: float, out: torch.Tensor) -> torch.Tensor:
        torch.div(x, c, out=out)
        return out.tanh_().mul_(c)

    def kv_store(
        self, kv: KVTensor, cells: torch.Tensor, x: torch.Tensor, scratch: list[torch.Tensor] | None = None
    ) -> None:
        """Write rows x (n, heads, d) at cells; quantised types are quantised as ggml does.
        A half-precision cache casts into `scratch` first (index_copy_ would allocate the cast)."""
        data = kv.data
        if data.dtype == torch.uint8:
            data.index_copy_(0, cells, QUANTIZERS[kv.ggml_type](x.reshape(x.shape[0], -1)))
            return
        if x.dtype != data.dtype:
            x = scratch[0].copy_(x) if scratch else x.to(data.dtype)
        data.index_copy_(0, cells, x)

    def kv_chunk(self, kv: KVTensor, start: int, n: int, out: torch.Tensor) -> torch.Tensor:
        """Cells [start, start + n) as f32, head-major: out (heads, n, d)."""
        data = kv.data
        if data.dtype != torch.uint8:
            return out.copy_(data[start : start + n].permute(1, 0, 2))
        rows = dequantize(data[start : start + n], kv.ggml_type, (n, kv.n_head, kv.head_dim))
        return out.copy_(rows.permute(1, 0, 2))

    def kv_rows(self, kv: KVTensor, cells: torch.Tensor) -> torch.Tensor:
        """Rows `cells` as a new f32 (n, heads, d) tensor (the K-shift re-rotates them)."""
        rows = kv.data.index_select(0, cells)
        if kv.data.dtype != torch.uint8:
            return rows.float()
        return dequantize(rows, kv.ggml_type, (cells.numel(), kv.n_head, kv.head_dim))

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
        """softmax(scale·q·kᵀ + mask)·v, reading the KV cache 256 cells at a time with an online
        softmax (flash attention's recurrence), so no buffer grows with the context.

        q (G, T, H, D), one group per KV stream; k, v: the layer's KV stores, cells [s, s + n_kv)
        of each stream start in `starts` (G,); mask (G, T, n_kv) additive; out (G·T, H·Dv);
        `visible[i]` False skips chunk i (no query sees any of its cells; read only on the CPU,
        where it costs no device sync). Query head h reads KV head h // (H / Hkv) (GQA).
        """
        starts_l = starts.tolist() if starts.device.type == "cpu" else starts.cpu().tolist()
        vis = visible.tolist() if visible is not None and visible.device.type == "cpu" else None
        g, t, n_head, d = q.shape
        n_head_kv, dv = k.n_head, v.head_dim
        r, b = n_head // n_head_kv, g * n_head_kv
        kc, vc, s, m, rowsum, tmp = scratch[:6]
        extra = scratch[attn_scratch_count(n_head_kv) :]  # what a backend's tile products asked for
        if n_head_kv == 1:  # MQA: every query head reads the one KV head; no permutes
            qh, acc = q.view(b, t * r, d), out.view(b, t * r, dv)
        else:
            qh, oh = scratch[6].view(b, t * r, d), scratch[7]
            scratch[6].copy_(q.view(g, t, n_head_kv, r, d).permute(0, 2, 1, 3, 4))
            acc = oh.view(b, t * r, dv)
        m.fill_(MASKED)
        rowsum.zero_()
        acc.zero_()
        for c0 in range(0, n_kv, KV_CHUNK):
            c = min(KV_CHUNK, n_kv - c0)
            if vis is not None and not vis[c0 // KV_CHUNK]:
                continue
            kcv, vcv = kc[:, :c], vc[:, :c]
            for gi, st in enumerate(starts_l):
                self.kv_chunk(k, st + c0, c, kcv[gi * n_head_kv : (gi + 1) * n_head_kv])
                self.kv_chunk(v, st + c0, c, vcv[gi * n_head_kv : (gi + 1) * n_head_kv])
            self.chunk_attention(qh, kcv, vcv, mask, c0, scale, m, rowsum, acc, [s, tmp, *extra], r)
        acc.div_(rowsum)
        if n_head_kv > 1:
            out.view(g, t, n_head_kv, r, dv).copy_(oh.permute(0, 2, 1, 3, 4))
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
        """Every query row (qh: b, t·r, d) over one chunk of cells (k, v: b, c, d | dv, starting
        at cell c0 of the mask): blocks of query_block tokens, each a score tile, its softmax
        step and its P·V; scratch is the score tile, the max tile and the tile products' own."""
        (s, tmp, *extra), b, c = scratch, qh.shape[0], k.shape[1]
        t = qh.shape[1] // r
        qb = query_block(t, r)  # tokens per score tile: the tile stays cache-sized
        for t0 in range(0, t, qb):
            tb = min(qb, t - t0)
            lo, hi = self.visible_span(mask, t0, tb, c0, c) if tb >= TRIM_MIN_TOKENS else (0, c)
            if lo >= hi:  # no query of this block sees any cell of the chunk
                continue
            cc = hi - lo
            mc = mask[:, t0 : t0 + tb, c0 + lo : c0 + hi]
            rows = slice(t0 * r, (t0 + tb) * r)
            sv, tv = s.view(-1)[: b * tb * r * cc].view(b, tb * r, cc), tmp[:, : tb * r]
            mv, lv, av = m[:, rows], rowsum[:, rows], acc[:, rows]
            self.score_tile(qh[:, rows], k[:, lo:hi], sv, extra)
            self.softmax_tile(sv, mc, scale, mv, lv, av, tv, r)
            self.value_tile(sv, v[:, lo:hi], av, extra)

    def score_tile(self, q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, scratch: list[torch.Tensor]) -> None:
        """out (b, rows, c) = q (b, rows, d) . k (b, c, d)ᵀ: one tile of prefill's scores."""
        torch.bmm(q, k.transpose(1, 2), out=out)

    def value_tile(self, p: torch.Tensor, v: torch.Tensor, acc: torch.Tensor, scratch: list[torch.Tensor]) -> None:
        """acc (b, rows, dv) += p (b, rows, c) . v (b, c, dv): the tile's weighted values."""
        acc.baddbmm_(p, v)

    def visible_span(self, mask: torch.Tensor, t0: int, tb: int, c0: int, c: int) -> tuple[int, int]:
        """[lo, hi): the cells of chunk [c0, c0 + c) that some query of rows [t0, t0 + tb) sees;
        the reference reads every tile whole (finding the span would allocate or sync)."""
        return 0, c

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
        """One online-softmax step on a score tile s (b, tb·r, c), in place: s = exp(scale·s +
        mask - m_new), with the running max m, sum and accumulator rows (b, tb·r, ·) brought up
        to date; mask (g, tb, c) is shared by the b / g KV heads of a group and the r query heads
        of a token."""
        b, rows, c = s.shape
        g, tb = mask.shape[0], mask.shape[1]
        if scale != 1.0:
            s.mul_(scale)
        s.view(g, b // g, tb, r, c).add_(mask[:, None, :, None, :])
        torch.amax(s, -1, keepdim=True, out=tmp)
        torch.maximum(tmp, m, out=tmp).clamp_(min=MASKED)  # new running max
        m.sub_(tmp).exp_()  # m now holds the correction exp(m_old - m_new)
        s.sub_(tmp).exp_()
        rowsum.mul_(m)
        acc.mul_(m)
        torch.sum(s, -1, keepdim=True, out=m)
        rowsum.add_(m)
        m.copy_(tmp)

    def rope_cache(
        self, pos: torch.Tensor, n_rot: int, base: float, scale: float, freq_factors: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of θ = p·scale·base^(-2i/n_rot) / f_i for each position in `pos`.

        Rows come from a per-(base, scale) table computed in float64 and grown by doubling, so a
        decode step is a gather instead of fresh transcendental calls.
        """
        key = (n_rot, base, scale, None if freq_factors is None else freq_factors.data_ptr())
        inv, cos, sin = self._rope_tables.get(key, (None, None, None))
        if inv is None:
            i = torch.arange(0, n_rot // 2, dtype=torch.float64)
            inv = scale * base ** (-2.0 * i / n_rot)
            if freq_factors is not None:  # llama 3.1+ rope_freqs.weight divides θ
                inv = inv / freq_factors.to(device="cpu", dtype=torch.float64)
        lo, hi = (int(pos.min()), int(pos.max())) if pos.numel() else (0, 0)
        if lo < 0:  # K-shift deltas can be negative: no table
            theta = pos.to("cpu", torch.float64)[:, None] * inv[None, :]
            return theta.cos().float().to(pos.device), theta.sin().float().to(pos.device)
        if cos is None or cos.shape[0] <= hi or cos.device != pos.device:
            size = max(1024, 1 << hi.bit_length())
            theta = torch.arange(size, dtype=torch.float64)[:, None] * inv[None, :]
            cos, sin = theta.cos().float().to(pos.device), theta.sin().float().to(pos.device)
        self._rope_tables[key] = (inv, cos, sin)
        idx = pos.long()
        return cos[idx], sin[idx]
