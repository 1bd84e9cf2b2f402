"""The op interface the forward pass calls, and its torch implementation.

Every op the model graph needs lives here behind `Ops`, so a Triton backend can replace any of
them without touching `engine/`. Ops accept an optional `out` buffer to write into (the workspace
planner hands out views of one buffer); without it they allocate.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .weight import QWeight


class Ops(Protocol):
    name: str

    def get_rows(self, w: QWeight, ids: torch.Tensor) -> torch.Tensor: ...
    def linear(self, x: torch.Tensor, w: QWeight, out: torch.Tensor | None = None) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor: ...
    def rope_cache(self, pos: torch.Tensor, n_rot: int, base: float, scale: float,
                   freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor: ...
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float, out: torch.Tensor | None = None) -> torch.Tensor: ...
    def glu(self, gate: torch.Tensor, up: torch.Tensor, act: str,
            out: torch.Tensor | None = None) -> torch.Tensor: ...


class TorchOps:
    """Reference implementation: plain torch, any device; f32 activations throughout.

    Gemma's residual stream reaches ~1e5, beyond fp16, so activations stay in f32.
    """

    name = "torch"

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        self.compute_dtype = compute_dtype
        self._rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get_rows(self, w: QWeight, ids: torch.Tensor) -> torch.Tensor:
        return w.rows(ids, self.compute_dtype).float()

    def linear(self, x: torch.Tensor, w: QWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        wd = w.dense(self.compute_dtype)
        if wd.dtype != x.dtype:
            return torch.matmul(x.to(wd.dtype), wd.t()).float()
        return torch.matmul(x, wd.t(), out=out)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return torch.mul(x * r, w, out=out)

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

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
        """x: (n_tokens, n_head, head_dim); rotates the first n_rot = 2*cos.shape[1] dims."""
        half = cos.shape[1]
        c, s = cos[:, None, :], sin[:, None, :]
        out = x.clone()
        if neox:
            a, b = x[..., :half], x[..., half : 2 * half]
            out[..., :half] = a * c - b * s
            out[..., half : 2 * half] = a * s + b * c
        else:
            a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
            out[..., 0 : 2 * half : 2] = a * c - b * s
            out[..., 1 : 2 * half : 2] = a * s + b * c
        return out

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """Queries against KV cells, per group (one group per KV stream in the ubatch).

        q (G, T, H, D); k, v (G, n_kv, H_kv, D); mask (G, T, n_kv) additive -> (G*T, H*Dv).
        GQA: query head h reads KV head h // (H / H_kv).
        """
        g, t, n_head, _ = q.shape
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2),
            attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=k.shape[2] != n_head,
        )
        res = a.transpose(1, 2).reshape(g * t, -1)
        if out is not None:
            out.copy_(res)
            return out
        return res

    def glu(self, gate: torch.Tensor, up: torch.Tensor, act: str,
            out: torch.Tensor | None = None) -> torch.Tensor:
        g = F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)
        return torch.mul(g, up, out=out)

