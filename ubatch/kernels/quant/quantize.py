"""Quantise f32 rows to Q8_0 / Q4_0 blocks in torch: the KV cache's quantised types (-ctk/-ctv).

Same arithmetic as ggml's reference quantisers (and gguf-py's), so a row written to a q8_0
cache holds the bytes llama.cpp would store.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C roundf: halves away from zero (torch.round rounds halves to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """(..., n) float -> (..., n/32*34) uint8: per block d = amax/127, q = roundf(x/d)."""
    b = x.float().reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(b * inv).to(torch.int8)
    out = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], 1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """(..., n) float -> (..., n/32*18) uint8: d = (signed max-magnitude value)/-8, 4-bit codes."""
    b = x.float().reshape(-1, 32)
    mx = b.gather(1, b.abs().argmax(1, keepdim=True))
    d = mx / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    out = torch.cat([d.half().view(torch.uint8), qs], 1)
    return out.reshape(*x.shape[:-1], -1)


QUANTIZERS = {int(T.Q8_0): quantize_q8_0, int(T.Q4_0): quantize_q4_0}
