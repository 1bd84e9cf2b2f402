"""The torch reference backend: plain torch ops on any device, weights dequantised once to f32.

It is the yardstick every other backend is tested against (tests/test_kernels.py) and the
fallback when no faster backend can run. Its dense copies are the only memory a backend holds
beyond the file's tensor bytes, and `held_bytes` says so. The other backends compose it for
the ops they do not accelerate; its chunked attention takes its steps from an `AttentionTiles`,
which a backend may replace with its own kernels (kernels/cpu/ops.py `CpuTiles`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ubatch.kernels.ops import (
    KV_CHUNK,
    MASKED,
    TRIM_MIN_TOKENS,
    AttentionArgs,
    KVTensor,
    LoraArgs,
    MaskCells,
    MoeTopKArgs,
    MoeWeightsArgs,
    MulMatIdArgs,
    Ops,
    ScratchSpec,
    attn_scratch_count,
    query_block,
)
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.quantize import QUANTIZERS
from ubatch.kernels.quant.weight import QWeight

SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0  # gpt-oss's gated activation (ggml_swiglu_oai's constants)


@dataclass(slots=True)
class OnlineSoftmax:
    """Flash attention's running state for rows of queries (b, rows, ·), each row a (token,
    query head) pair, and the constants of its recurrence."""

    m: Tensor  # the running max (b, rows, 1)
    rowsum: Tensor  # the running sum (b, rows, 1)
    acc: Tensor  # the output so far, unnormalised (b, rows, dv)
    tmp: Tensor  # a tile's new max (b, >= tile rows, 1)
    scale: float
    r: int  # query heads per KV head
    softcap: float = 0.0  # scores capped as softcap·tanh(s / softcap) first (0: off)

    def block(self, rows: slice) -> OnlineSoftmax:
        """The state of rows [start, stop) (a query block's tile)."""
        n = rows.stop - rows.start
        m, rowsum, acc = self.m[:, rows], self.rowsum[:, rows], self.acc[:, rows]
        return OnlineSoftmax(m, rowsum, acc, self.tmp[:, :n], self.scale, self.r, self.softcap)


class AttentionTiles:
    """The reference's steps of attention over one chunk of cells: blocks of query_block tokens,
    each a score tile, its online-softmax step and its P·V. A backend overrides the steps it
    computes faster and hands its tiles to the `TorchOps` it composes."""

    def chunk_attention(
        self, qh: Tensor, k: Tensor, v: Tensor, mask: Tensor, c0: int, state: OnlineSoftmax, scratch: list[Tensor]
    ) -> None:
        """Every query row (qh: b, t·r, d) over one chunk of cells (k, v: b, c, d | dv, starting
        at cell c0 of the mask); scratch is the score tile and the tile products' own."""
        (s, *extra), b, c = scratch, qh.shape[0], k.shape[1]
        r = state.r
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
            sv = s.view(-1)[: b * tb * r * cc].view(b, tb * r, cc)
            block = state.block(rows)
            self.score_tile(qh[:, rows], k[:, lo:hi], sv, extra)
            self.softmax_tile(sv, mc, block)
            self.value_tile(sv, v[:, lo:hi], block.acc, extra)

    def score_tile(self, q: Tensor, k: Tensor, out: Tensor, scratch: list[Tensor]) -> None:
        """out (b, rows, c) = q (b, rows, d) . k (b, c, d)ᵀ: one tile of prefill's scores."""
        torch.bmm(q, k.transpose(1, 2), out=out)

    def value_tile(self, p: Tensor, v: Tensor, acc: Tensor, scratch: list[Tensor]) -> None:
        """acc (b, rows, dv) += p (b, rows, c) . v (b, c, dv): the tile's weighted values."""
        acc.baddbmm_(p, v)

    def visible_span(self, mask: Tensor, t0: int, tb: int, c0: int, c: int) -> tuple[int, int]:
        """[lo, hi): the cells of chunk [c0, c0 + c) that some query of rows [t0, t0 + tb) sees;
        the reference reads every tile whole (finding the span would allocate or sync)."""
        return 0, c

    def softmax_tile(self, s: Tensor, mask: Tensor, state: OnlineSoftmax) -> None:
        """One online-softmax step on a score tile s (b, tb·r, c), in place: s = exp(scale·s +
        mask - m_new), with the block's running max, sum and output brought up to date; mask
        (g, tb, c) is shared by the b / g KV heads of a group and the r query heads of a token."""
        b, rows, c = s.shape
        g, tb = mask.shape[0], mask.shape[1]
        m, tmp = state.m, state.tmp
        if state.softcap:  # llama.cpp's order: cap the raw scores, then scale, then mask
            s.div_(state.softcap).tanh_().mul_(state.softcap)
        if state.scale != 1.0:
            s.mul_(state.scale)
        s.view(g, b // g, tb, state.r, c).add_(mask[:, None, :, None, :])
        torch.amax(s, -1, keepdim=True, out=tmp)
        torch.maximum(tmp, m, out=tmp).clamp_(min=MASKED)  # new running max
        m.sub_(tmp).exp_()  # m now holds the correction exp(m_old - m_new)
        s.sub_(tmp).exp_()
        state.rowsum.mul_(m)
        state.acc.mul_(m)
        torch.sum(s, -1, keepdim=True, out=m)
        state.rowsum.add_(m)
        m.copy_(tmp)


def mask_from_cells(t: int, cells: MaskCells[Tensor]) -> Tensor:
    """The additive (G, T, n_kv) f16 mask the cells' rules give (as KVCache.mask does), for a
    backend that masks in its kernel but hands a call to the reference."""
    cpos, cseq = cells.cell_pos, cells.cell_seq
    g = cpos.shape[0]
    qp, ql, qs = (x.view(g, t, 1) for x in (cells.query_pos, cells.query_lim, cells.query_seq))
    vis = (cpos[:, None, :] >= 0) & ((cseq[:, None, :] & qs) != 0) & (cpos[:, None, :] <= ql)
    if cells.n_swa > 0:
        vis &= qp - cpos[:, None, :] < cells.n_swa
    zero = torch.zeros((), dtype=torch.float16, device=cpos.device)
    return torch.where(vis, zero, torch.tensor(float("-inf"), dtype=torch.float16, device=cpos.device))


def _cells(a: AttentionArgs[Tensor]) -> MaskCells[Tensor]:
    if a.cells is None:
        raise ValueError("attention needs a mask tensor or the cells to compute it from")
    return a.cells


class TorchOps(Ops):
    """Reference implementation: plain torch on any device, weights dequantised once to f32;
    attention reads the engine's [n_tokens, n_kv] mask tensor."""

    name = "torch"

    def __init__(
        self, n_threads: int = 1, compute_dtype: torch.dtype = torch.float32, tiles: AttentionTiles | None = None
    ) -> None:
        self.compute_dtype = compute_dtype
        self.n_threads = n_threads
        self.notices: list[str] = []
        self.tiles = tiles or AttentionTiles()  # attention's steps over a chunk of cells
        self._rope_tables: dict[
            tuple[int, float, float, int | None], tuple[Tensor, Tensor, Tensor]
        ] = {}  # (1/freq, cos, sin)
        self._weights: list[QWeight] = []
        self._dense: dict[QWeight, Tensor] = {}

    # -- weights --------------------------------------------------------------------------------
    def prepare_weights(self, weights: list[QWeight]) -> None:
        """The reference multiplies dense copies, each made at its first use: a context that is
        only planned (`ubatch info`, `--fit`) dequantises nothing."""
        self._weights += [w for w in weights if w not in self._weights]

    def dense(self, w: QWeight) -> Tensor:
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
    def get_rows(self, w: QWeight, ids: Tensor, out: Tensor) -> Tensor:
        return torch.index_select(self.dense(w), 0, ids, out=out)

    def linear(self, x: Tensor, w: QWeight, out: Tensor, scratch: list[Tensor] | None = None) -> Tensor:
        return torch.mm(x, self.dense(w).t(), out=out)

    def rms_norm(self, x: Tensor, w: Tensor, eps: float, out: Tensor, scratch: list[Tensor]) -> Tensor:
        """x / sqrt(mean(x²) + eps) * w, over the last dim; scratch[0] holds one value per row."""
        r = scratch[0]
        torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True, out=r)
        r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        torch.mul(x, r, out=out)
        return out.mul_(w)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, neox: bool, out: Tensor) -> Tensor:
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

    def scale(self, x: Tensor, s: float, out: Tensor) -> Tensor:
        return torch.mul(x, s, out=out)

    def add(self, a: Tensor, b: Tensor, out: Tensor) -> Tensor:
        return torch.add(a, b, out=out)

    def glu(self, gate: Tensor, up: Tensor, act: str, out: Tensor) -> Tensor:
        if act == "swiglu_oai":  # gpt-oss: gate capped, up clamped, x·sigmoid(1.702·x)·(up + 1)
            g = gate.clamp(max=SWIGLU_OAI_LIMIT)
            u = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
            return torch.mul(g * torch.sigmoid(SWIGLU_OAI_ALPHA * g), u + 1.0, out=out)
        if act == "gelu_tanh":
            torch.ops.aten.gelu.out(gate, approximate="tanh", out=out)
        else:
            torch.ops.aten.silu.out(gate, out=out)
        return out.mul_(up)

    def add_bias(self, x: Tensor, b: Tensor, out: Tensor) -> Tensor:
        return torch.add(x, b, out=out)

    def lora(self, a: LoraArgs[Tensor], out: Tensor) -> Tensor:
        """The rows of each (slot, adapter) as one group: t = (x A_kᵀ) · c_k · scale, y += t B_kᵀ
        (the groups are read on the host; the C and Triton kernels gather per row instead)."""
        w, x = a.w, a.x
        idx, scale = (a.idx, a.scale) if a.sel is None else (a.idx[a.sel], a.scale[a.sel])
        delta = torch.zeros_like(out)
        for j in range(idx.shape[1]):
            for k in torch.unique(idx[:, j]).tolist():
                r = int(w.rank[k]) if k >= 0 else 0
                if r == 0:
                    continue
                rows = torch.nonzero(idx[:, j] == k).squeeze(1)
                t = x[rows] @ w.a[k, :r].float().t() * (scale[rows, j] * w.c[k]).unsqueeze(1)
                delta[rows] += t @ w.bt[k, :r].float()
        return torch.add(a.y, delta, out=out)

    def rows(self, x: Tensor, idx: Tensor, out: Tensor) -> Tensor:
        return torch.index_select(x, 0, idx, out=out)

    def cols(self, x: Tensor, start: int, out: Tensor) -> Tensor:
        return out.copy_(x[..., start : start + out.shape[-1]])

    def sigmoid_scale(self, x: Tensor, g: Tensor, out: Tensor) -> Tensor:
        return torch.mul(x, torch.sigmoid(g), out=out)

    def concat(self, a: Tensor, b: Tensor, out: Tensor) -> Tensor:
        out[..., : a.shape[-1]].copy_(a)
        out[..., a.shape[-1] :].copy_(b)
        return out

    # -- mixtures of experts --------------------------------------------------------------------
    def mul_mat_id(self, a: MulMatIdArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        """The (token, chosen expert) rows grouped by expert, each group one product with that
        expert's dense copy (the group sizes are read on the host)."""
        n, k = a.ids.shape
        e_count, rows, cols = a.w.shape
        w = self.dense(a.w)
        xf = a.x.expand(n, k, cols).reshape(n * k, cols)
        of = out.view(n * k, rows)
        flat = a.ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        start = 0
        for e, c in enumerate(torch.bincount(flat, minlength=e_count).tolist()):
            if c:
                sel = order[start : start + c]
                y = xf.index_select(0, sel) @ w[e].t()
                of.index_copy_(0, sel, y if a.b is None else y.add_(a.b[e]))
                start += c
        return out

    @staticmethod
    def gating_probs(logits: Tensor, gating: str) -> Tensor:
        """The router's probabilities over all experts (softmax_weight: the raw logits)."""
        if gating == "softmax":
            return torch.softmax(logits, -1)
        if gating == "sigmoid":
            return torch.sigmoid(logits)
        return logits

    def moe_topk(self, a: MoeTopKArgs[Tensor], out: Tensor) -> Tensor:
        p = self.gating_probs(a.logits, a.gating)
        if a.bias is not None:
            p = p + a.bias
        if a.n_group > 1:  # the other groups' experts out of the choice
            groups = p.view(p.shape[0], a.n_group, -1)
            best = torch.topk(groups.topk(2, -1).values.sum(-1), a.n_group_used, -1).indices
            keep = torch.zeros(groups.shape[:2], dtype=torch.bool, device=p.device).scatter_(1, best, True)
            p = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(p)
        return out.copy_(torch.topk(p, a.k, -1).indices)

    def moe_weights(self, a: MoeWeightsArgs[Tensor], out: Tensor) -> Tensor:
        w = torch.gather(self.gating_probs(a.logits, a.gating), 1, a.ids.long())
        if a.gating == "softmax_weight":
            w = torch.softmax(w, -1)
        if a.norm:  # llama.cpp clamps the sum at f16's smallest normal
            w = w / w.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
        return torch.mul(w, a.scale, out=out)

    def moe_sum(self, x: Tensor, weights: Tensor, out: Tensor) -> Tensor:
        torch.bmm(weights.unsqueeze(1), x, out=out.unsqueeze(1))
        return out

    def softcap(self, x: Tensor, c: float, out: Tensor) -> Tensor:
        torch.div(x, c, out=out)
        return out.tanh_().mul_(c)

    def kv_store(self, kv: KVTensor, cells: Tensor, x: Tensor, scratch: list[Tensor] | None = None) -> None:
        """Write rows x (n, heads, d) at cells; quantised types are quantised as ggml does.
        A half-precision cache casts into `scratch` first (index_copy_ would allocate the cast)."""
        data = kv.data
        if data.dtype == torch.uint8:
            data.index_copy_(0, cells, QUANTIZERS[kv.ggml_type](x.reshape(x.shape[0], -1)))
            return
        if x.dtype != data.dtype:
            x = scratch[0].copy_(x) if scratch else x.to(data.dtype)
        data.index_copy_(0, cells, x)

    def kv_chunk(self, kv: KVTensor, start: int, n: int, out: Tensor) -> Tensor:
        """Cells [start, start + n) as f32, head-major: out (heads, n, d)."""
        data = kv.data
        if data.dtype != torch.uint8:
            return out.copy_(data[start : start + n].permute(1, 0, 2))
        rows = dequantize(data[start : start + n], kv.ggml_type, (n, kv.n_head, kv.head_dim))
        return out.copy_(rows.permute(1, 0, 2))

    def kv_rows(self, kv: KVTensor, cells: Tensor) -> Tensor:
        """Rows `cells` as a new f32 (n, heads, d) tensor (the K-shift re-rotates them)."""
        rows = kv.data.index_select(0, cells)
        if kv.data.dtype != torch.uint8:
            return rows.float()
        return dequantize(rows, kv.ggml_type, (cells.numel(), kv.n_head, kv.head_dim))

    def attention(self, a: AttentionArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        """softmax(scale·q·kᵀ + mask)·v, reading the KV cache 256 cells at a time with an online
        softmax (flash attention's recurrence), so no buffer grows with the context; each chunk
        is the tiles' (`AttentionTiles`). Without a mask tensor, the mask is built from
        `a.cells` for the call. `visible` is read only on the CPU, where it costs no device sync.
        """
        q, k, v, starts = a.q, a.k, a.v, a.starts
        g, t, n_head, d = q.shape
        mask = a.mask if a.mask is not None else mask_from_cells(t, _cells(a))
        starts_l = starts.tolist() if starts.device.type == "cpu" else starts.cpu().tolist()
        vis = a.visible.tolist() if a.visible is not None and a.visible.device.type == "cpu" else None
        n_head_kv, dv = k.n_head, v.head_dim
        r, b = n_head // n_head_kv, g * n_head_kv
        kc, vc, s, m, rowsum, tmp = scratch[:6]
        extra = scratch[attn_scratch_count(n_head_kv) :]  # what a backend's tiles asked for
        if n_head_kv == 1:  # MQA: every query head reads the one KV head; no permutes
            qh, acc = q.view(b, t * r, d), out.view(b, t * r, dv)
        else:
            qh, oh = scratch[6].view(b, t * r, d), scratch[7]
            scratch[6].copy_(q.view(g, t, n_head_kv, r, d).permute(0, 2, 1, 3, 4))
            acc = oh.view(b, t * r, dv)
        if a.sinks is None:
            m.fill_(MASKED)
            rowsum.zero_()
        else:  # the sink as a cell seen first: its logit is the running max, its exp(0) = 1 the sum
            m.copy_(a.sinks.view(1, n_head_kv, 1, r).expand(g, n_head_kv, t, r).reshape(b, t * r, 1))
            rowsum.fill_(1.0)
        acc.zero_()
        state = OnlineSoftmax(m, rowsum, acc, tmp, a.scale, r, a.softcap)
        for c0 in range(0, a.n_kv, KV_CHUNK):
            c = min(KV_CHUNK, a.n_kv - c0)
            if vis is not None and not vis[c0 // KV_CHUNK]:
                continue
            kcv, vcv = kc[:, :c], vc[:, :c]
            for gi, st in enumerate(starts_l):
                self.kv_chunk(k, st + c0, c, kcv[gi * n_head_kv : (gi + 1) * n_head_kv])
                self.kv_chunk(v, st + c0, c, vcv[gi * n_head_kv : (gi + 1) * n_head_kv])
            self.tiles.chunk_attention(qh, kcv, vcv, mask, c0, state, [s, *extra])
        acc.div_(rowsum)
        if n_head_kv > 1:
            out.view(g, t, n_head_kv, r, dv).copy_(oh.permute(0, 2, 1, 3, 4))
        return out

    def rope_cache(
        self, pos: Tensor, n_rot: int, base: float, scale: float, freq_factors: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """cos/sin of θ = p·scale·base^(-2i/n_rot) / f_i for each position in `pos`.

        Rows come from a per-(base, scale) table computed in float64 and grown by doubling, so a
        decode step is a gather instead of fresh transcendental calls.
        """
        key = (n_rot, base, scale, None if freq_factors is None else freq_factors.data_ptr())
        table = self._rope_tables.get(key)
        if table is None:
            i = torch.arange(0, n_rot // 2, dtype=torch.float64)
            inv = scale * base ** (-2.0 * i / n_rot)
            if freq_factors is not None:  # llama 3.1+ rope_freqs.weight divides θ
                inv = inv / freq_factors.to(device="cpu", dtype=torch.float64)
        else:
            inv, cos, sin = table
        lo, hi = (int(pos.min()), int(pos.max())) if pos.numel() else (0, 0)
        if lo < 0:  # K-shift deltas can be negative: no table
            theta = pos.to("cpu", torch.float64)[:, None] * inv[None, :]
            return theta.cos().float().to(pos.device), theta.sin().float().to(pos.device)
        if table is None or cos.shape[0] <= hi or cos.device != pos.device:
            size = max(1024, 1 << hi.bit_length())
            theta = torch.arange(size, dtype=torch.float64)[:, None] * inv[None, :]
            cos, sin = theta.cos().float().to(pos.device), theta.sin().float().to(pos.device)
        self._rope_tables[key] = (inv, cos, sin)
        idx = pos.long()
        return cos[idx], sin[idx]
