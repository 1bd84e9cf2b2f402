"""The ops a model graph is made of, and their torch implementation.

Every op writes into an `out` tensor it is given (a view of the workspace) and takes any
scratch it needs as views too, so a planned forward pass allocates nothing on its own; a
Triton backend replaces these methods one by one without touching `engine/`. Activations are
f32 throughout: Gemma's residual stream reaches ~1e5, beyond fp16.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .weight import QWeight

KV_CHUNK = 256  # cells per attention step (n_kv is always a multiple of 256)
MASKED = -1e30  # running-max floor: rows that have seen only masked cells stay finite


def attn_scratch(g: int, t: int, n_head: int, n_head_kv: int, n_kv: int, d: int,
                 dv: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Scratch of the attention op: one chunk of K and V in f32, the score tile for a chunk,
    three per-row statistics, and for GQA (n_head_kv > 1) head-major copies of q and of the
    output. Only the score tile grows with the ubatch; nothing grows with the context."""
    r, c, b = n_head // n_head_kv, min(KV_CHUNK, n_kv), g * n_head_kv
    out = [((b, c, d), torch.float32), ((b, c, dv), torch.float32), ((b, t * r, c), torch.float32),
           ((b, t * r, 1), torch.float32), ((b, t * r, 1), torch.float32), ((b, t * r, 1), torch.float32)]
    if n_head_kv > 1:
        out += [((g, n_head_kv, t, r, d), torch.float32), ((g, n_head_kv, t, r, dv), torch.float32)]
    return out


class Ops(Protocol):
    """The op set of llama / gemma3 graphs. `out` may alias the first input where noted."""

    name: str

    def get_rows(self, w: QWeight, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...
    def linear(self, x: torch.Tensor, w: QWeight, out: torch.Tensor) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor,
                 scratch: list[torch.Tensor]) -> torch.Tensor: ...
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool,
             out: torch.Tensor) -> torch.Tensor: ...
    def scale(self, x: torch.Tensor, s: float, out: torch.Tensor) -> torch.Tensor: ...  # in place ok
    def add(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...  # in place ok
    def glu(self, gate: torch.Tensor, up: torch.Tensor, act: str, out: torch.Tensor) -> torch.Tensor: ...
    def rows(self, x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...
    def softcap(self, x: torch.Tensor, c: float, out: torch.Tensor) -> torch.Tensor: ...
    def kv_store(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None: ...
    def kv_chunk(self, cache: torch.Tensor, start: int, n: int, out: torch.Tensor) -> torch.Tensor: ...
    def attention(self, q: torch.Tensor, k: Any, v: Any, starts: list[int], n_kv: int,
                  mask: torch.Tensor, scale: float, out: torch.Tensor, scratch: list[torch.Tensor],
                  visible: list[bool] | None = None) -> torch.Tensor: ...
    def rope_cache(self, pos: torch.Tensor, n_rot: int, base: float, scale: float,
                   freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


class TorchOps:
    """Reference implementation: plain torch on any device, weights dequantised once to f32."""

    name = "torch"

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        self.compute_dtype = compute_dtype
        self._rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get_rows(self, w: QWeight, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.index_select(w.dense(self.compute_dtype), 0, ids, out=out)

    def linear(self, x: torch.Tensor, w: QWeight, out: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w.dense(self.compute_dtype).t(), out=out)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor,
                 scratch: list[torch.Tensor]) -> torch.Tensor:
        """x / sqrt(mean(x²) + eps) * w, over the last dim; scratch[0] holds one value per row."""
        r = scratch[0]
        torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True, out=r)
        r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        torch.mul(x, r, out=out)
        return out.mul_(w)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool,
             out: torch.Tensor) -> torch.Tensor:
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

    def kv_store(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Write rows into the cache (float types; quantised caches go through KVStore)."""
        cache.index_copy_(0, slots, x.to(cache.dtype) if x.dtype != cache.dtype else x)

    def kv_chunk(self, cache: torch.Tensor, start: int, n: int, out: torch.Tensor) -> torch.Tensor:
        """Cells [start, start + n) of a float cache as f32, head-major: out (heads, n, d)."""
        return out.copy_(cache[start : start + n].permute(1, 0, 2))

    def attention(self, q: torch.Tensor, k: Any, v: Any, starts: list[int], n_kv: int,
                  mask: torch.Tensor, scale: float, out: torch.Tensor, scratch: list[torch.Tensor],
                  visible: list[bool] | None = None) -> torch.Tensor:
        """softmax(scale·q·kᵀ + mask)·v, reading the KV cache 256 cells at a time with an online
        softmax (flash attention's recurrence), so no buffer grows with the context.

        q (G, T, H, D), one group per KV stream; k, v: the layer's KV stores, cells [s, s + n_kv)
        of each stream s in `starts`; mask (G, T, n_kv) additive; out (G·T, H·Dv); `visible[i]`
        False skips chunk i (no query sees any of its cells). Query head h reads KV head
        h // (H / Hkv) (GQA).
        """
        g, t, n_head, d = q.shape
        n_head_kv, dv = k.n_head, v.head_dim
        r, b = n_head // n_head_kv, g * n_head_kv
        kc, vc, s, m, l, tmp = scratch[:6]
        if n_head_kv == 1:  # MQA: every query head reads the one KV head; no permutes
            qh, acc = q.view(b, t * r, d), out.view(b, t * r, dv)
        else:
            qh, oh = scratch[6].view(b, t * r, d), scratch[7]
            scratch[6].copy_(q.view(g, t, n_head_kv, r, d).permute(0, 2, 1, 3, 4))
            acc = oh.view(b, t * r, dv)
        m.fill_(MASKED)
        l.zero_()
        acc.zero_()
        for c0 in range(0, n_kv, KV_CHUNK):
            c = min(KV_CHUNK, n_kv - c0)
            if visible is not None and not visible[c0 // KV_CHUNK]:
                continue
            mc = mask[:, :, c0 : c0 + c]
            kcv, vcv, sv = kc[:, :c], vc[:, :c], s[:, :, :c]
            for gi, st in enumerate(starts):
                k.chunk(st + c0, c, kcv[gi * n_head_kv : (gi + 1) * n_head_kv], self)
                v.chunk(st + c0, c, vcv[gi * n_head_kv : (gi + 1) * n_head_kv], self)
            torch.bmm(qh, kcv.transpose(1, 2), out=sv)
            sv.mul_(scale)
            sv.view(g, n_head_kv, t, r, c).add_(mc[:, None, :, None, :])
            torch.amax(sv, -1, keepdim=True, out=tmp)
            torch.maximum(tmp, m, out=tmp).clamp_(min=MASKED)  # new running max
            m.sub_(tmp).exp_()  # m now holds the correction exp(m_old - m_new)
            sv.sub_(tmp).exp_()
            l.mul_(m)
            acc.mul_(m)
            torch.sum(sv, -1, keepdim=True, out=m)
            l.add_(m)
            acc.baddbmm_(sv, vcv)
            m.copy_(tmp)
        acc.div_(l)
        if n_head_kv > 1:
            out.view(g, t, n_head_kv, r, dv).copy_(oh.permute(0, 2, 1, 3, 4))
        return out

    def rope_cache(self, pos: torch.Tensor, n_rot: int, base: float, scale: float,
                   freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of θ = p·scale·base^(-2i/n_rot) / f_i for each position in `pos`.

        Rows come from a per-(base, scale) table computed in float64 and grown by doubling, so a
        decode step is a gather instead of fresh transcendental calls.
        """
        i = torch.arange(0, n_rot // 2, dtype=torch.float64, device=pos.device)
        inv = scale * base ** (-2.0 * i / n_rot)
        if freq_factors is not None:  # llama 3.1+ rope_freqs.weight divides θ
            inv = inv / freq_factors.to(device=pos.device, dtype=torch.float64)
        if pos.numel() and int(pos.min()) < 0:  # K-shift deltas can be negative: no table
            theta = pos.to(torch.float64)[:, None] * inv[None, :]
            return theta.cos().float(), theta.sin().float()
        key = (n_rot, base, scale, None if freq_factors is None else freq_factors.data_ptr())
        need = int(pos.max()) + 1 if pos.numel() else 1
        cos, sin = self._rope_tables.get(key, (None, None))
        if cos is None or cos.shape[0] < need or cos.device != pos.device:
            size = max(1024, 1 << (need - 1).bit_length())
            theta = torch.arange(size, dtype=torch.float64, device=pos.device)[:, None] * inv[None, :]
            cos, sin = theta.cos().float(), theta.sin().float()
            self._rope_tables[key] = (cos, sin)
        idx = pos.long()
        return cos[idx], sin[idx]


