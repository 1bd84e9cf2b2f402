"""Dequantisation of the non-linear and grid types (MXFP4, IQ4_NL/XS, IQ3/IQ2/IQ1, TQ1_0/TQ2_0).

The same contract as kernels/quant/dequant.py, which registers these kernels: every block of a
chunk at once, each value computed in float32 with ggml's `dequantize_row_*` operations in
ggml's order (a scale times a table value, then a sign), so the result equals llama.cpp's bit
for bit. Lookup tables are facts of the formats: the 16-value tables and the sign rule here, the
grids in iq_grids.py (generated from ggml-common.h). Layouts: ggml-common.h's block structs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as T

from ubatch.kernels.quant.iq_grids import GRIDS

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 values, doubled
IQ1_DELTA = 0.125


def grid_bytes(name: str) -> torch.Tensor:
    """A grid of iq_grids.GRIDS as an (entries, 8 or 4) tensor of its byte values (int16)."""
    values, bits, width, codes = GRIDS[name]
    digits = -(-bits * width // 4)
    packed = torch.tensor([int(codes[i : i + digits], 16) for i in range(0, len(codes), digits)])
    idx = (packed.unsqueeze(1) >> (bits * torch.arange(width))) & ((1 << bits) - 1)
    return torch.tensor(values, dtype=torch.int16)[idx]


def grid_raw(name: str) -> bytes:
    """A grid's entries as the C kernels read them: 8 or 4 bytes each (int8: every value fits)."""
    return grid_bytes(name).to(torch.int8).numpy().tobytes()


@functools.cache
def _table(name: str, device: torch.device) -> torch.Tensor:
    """A lookup table as float32 on a device (grids from iq_grids.py, the 16-value ones above)."""
    small = {"iq4nl": KVALUES_IQ4NL, "mxfp4": KVALUES_MXFP4}
    t = torch.tensor(small[name]) if name in small else grid_bytes(name)
    return t.float().to(device)


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The little-endian half at byte `off` of every block, as float32 (n, 1)."""
    return b[:, off : off + 2].contiguous().view(torch.float16).float()


def _u(b: torch.Tensor, width: int) -> torch.Tensor:
    """(n, m * width) little-endian bytes -> (n, m) unsigned integers (int64)."""
    w = b.reshape(b.shape[0], -1, width).long()
    out = w[..., 0]
    for i in range(1, width):
        out = out | (w[..., i] << (8 * i))
    return out


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k, 16) bytes -> (n, k, 32) codes: the low nibbles of the run, then its high ones."""
    return torch.cat((qs & 15, qs >> 4), dim=-1).long()


def _sign_bits(s: torch.Tensor, n_bits: int = 8) -> torch.Tensor:
    """(...,) sign bytes -> (..., n_bits) bools: bit j set means value j is negated."""
    return ((s.unsqueeze(-1) >> torch.arange(n_bits, device=s.device)) & 1).bool()


def _ksigns(k: torch.Tensor) -> torch.Tensor:
    """ggml's ksigns_iq2xs: a 7-bit index and, as bit 7, the parity of its set bits."""
    parity = k
    for sh in (4, 2, 1):
        parity = parity ^ (parity >> sh)
    return k | ((parity & 1) << 7)


def _signed(v: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """v times -1 where `neg` (exact: a negation), as ggml's `* (neg ? -1.f : 1.f)`."""
    return torch.where(neg, -v, v)


def _mxfp4(b: torch.Tensor, out: torch.Tensor) -> None:
    e = b[:, 0:1].int()
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)  # 2^(e-128): half of E8M0's 2^(e-127)
    d = bits.view(torch.float32)
    q = _table("mxfp4", b.device)[_nibbles(b[:, 1:17])]
    torch.mul(q, d, out=out)


def _iq4_nl(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _table("iq4nl", b.device)[_nibbles(b[:, 2:18])]
    torch.mul(_f16(b, 0), q, out=out)


def _iq4_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    ib = torch.arange(8, device=b.device)
    lo = (b[:, 4:8].long().repeat_interleave(2, dim=1) >> (4 * (ib % 2))) & 15
    hi = (_u(b[:, 2:4], 2) >> (2 * ib)) & 3
    dl = (_f16(b, 0) * ((lo | (hi << 4)) - 32).float()).unsqueeze(-1)  # (n, 8, 1)
    q = _table("iq4nl", b.device)[_nibbles(b[:, 8:136].view(-1, 8, 16))]
    torch.mul(dl, q, out=out.view(-1, 8, 32))


def _iq2_xxs(b: torch.Tensor, out: torch.Tensor) -> None:
    aux = _u(b[:, 2:66], 4).view(-1, 8, 2)  # per 32 values: four grid indices, then signs and scale
    db = (_f16(b, 0) * (0.5 + (aux[..., 1] >> 28).float()) * 0.25).view(-1, 8, 1, 1)
    idx = (aux[..., 0:1] >> (8 * torch.arange(4, device=b.device))) & 255  # (n, 8, 4)
    signs = _ksigns((aux[..., 1:2] >> (7 * torch.arange(4, device=b.device))) & 127)
    v = db * _table("iq2xxs_grid", b.device)[idx]  # (n, 8, 4, 8)
    out.view(-1, 8, 4, 8).copy_(_signed(v, _sign_bits(signs)))


def _iq2_scales(d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """IQ2_XS/IQ2_S: (n, 8) scale bytes -> (n, 8, 4, 1) scales of each group of 8 values."""
    s4 = torch.stack((sc & 15, sc >> 4), dim=-1).float()  # groups 0-1 the low nibble, 2-3 the high
    db = d.unsqueeze(-1) * (0.5 + s4) * 0.25  # (n, 8, 2)
    return db.repeat_interleave(2, dim=-1).unsqueeze(-1)


def _iq2_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _u(b[:, 2:66], 2).view(-1, 8, 4)
    db = _iq2_scales(_f16(b, 0), b[:, 66:74])
    v = db * _table("iq2xs_grid", b.device)[q & 511]
    out.view(-1, 8, 4, 8).copy_(_signed(v, _sign_bits(_ksigns(q >> 9))))


def _iq2_s(b: torch.Tensor, out: torch.Tensor) -> None:
    l4 = torch.arange(4, device=b.device)
    qh = b[:, 66:74].long().unsqueeze(-1)  # (n, 8, 1)
    idx = b[:, 2:34].long().view(-1, 8, 4) | ((qh << (8 - 2 * l4)) & 0x300)
    db = _iq2_scales(_f16(b, 0), b[:, 74:82])
    v = db * _table("iq2s_grid", b.device)[idx]
    out.view(-1, 8, 4, 8).copy_(_signed(v, _sign_bits(b[:, 34:66].view(-1, 8, 4))))


def _iq3_xxs(b: torch.Tensor, out: torch.Tensor) -> None:
    aux = _u(b[:, 66:98], 4)  # (n, 8)
    db = (_f16(b, 0) * (0.5 + (aux >> 28).float()) * 0.5).view(-1, 8, 1, 1)
    signs = _ksigns((aux.unsqueeze(-1) >> (7 * torch.arange(4, device=b.device))) & 127)  # (n, 8, 4)
    g = _table("iq3xxs_grid", b.device)[b[:, 2:66].long().view(-1, 8, 4, 2)]  # (n, 8, 4, 2, 4)
    v = db * g.flatten(-2)
    out.view(-1, 8, 4, 8).copy_(_signed(v, _sign_bits(signs)))


def _iq3_s(b: torch.Tensor, out: torch.Tensor) -> None:
    qh = b[:, 66:74].long().unsqueeze(-1)  # (n, 8, 1): bit k is index k's ninth bit
    idx = b[:, 2:66].long().view(-1, 8, 8) | (((qh >> torch.arange(8, device=b.device)) & 1) << 8)
    sc = b[:, 106:110].long().repeat_interleave(2, dim=1) >> (4 * (torch.arange(8, device=b.device) % 2))
    db = (_f16(b, 0) * (1 + 2 * (sc & 15)).float()).view(-1, 8, 1, 1)
    g = _table("iq3s_grid", b.device)[idx].view(-1, 8, 4, 8)
    out.view(-1, 8, 4, 8).copy_(_signed(db * g, _sign_bits(b[:, 74:106].view(-1, 8, 4))))


def _iq1_s(b: torch.Tensor, out: torch.Tensor) -> None:
    qh = _u(b[:, 34:50], 2).unsqueeze(-1)  # (n, 8, 1)
    dl = (_f16(b, 0).unsqueeze(-1) * (2 * ((qh >> 12) & 7) + 1).float()).unsqueeze(-1)  # (n, 8, 1, 1)
    delta = torch.where((qh & 0x8000).bool(), -IQ1_DELTA, IQ1_DELTA).unsqueeze(-1)
    idx = b[:, 2:34].long().view(-1, 8, 4) | (((qh >> (3 * torch.arange(4, device=b.device))) & 7) << 8)
    g = _table("iq1s_grid", b.device)[idx]  # (n, 8, 4, 8)
    torch.mul(dl, g + delta, out=out.view(-1, 8, 4, 8))


def _iq1_m(b: torch.Tensor, out: torch.Tensor) -> None:
    sc = _u(b[:, 48:56], 2)  # (n, 4)
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = bits.to(torch.int16).view(torch.float16).float().view(-1, 1, 1)
    s = sc.repeat_interleave(2, dim=1).unsqueeze(-1)  # (n, 8, 1): sc[ib / 2]
    sh = (6 * (torch.arange(8, device=b.device) % 2)).view(1, 8, 1) + torch.tensor([0, 3], device=b.device)
    dl = (d * (2 * ((s >> sh) & 7) + 1).float()).repeat_interleave(2, dim=-1).unsqueeze(-1)  # (n, 8, 4, 1)
    qh = b[:, 32:48].long().view(-1, 8, 2).repeat_interleave(2, dim=-1)  # (n, 8, 4): qh[2ib + l / 2]
    odd = torch.tensor([0, 1, 0, 1], device=b.device)
    idx = b[:, 0:32].long().view(-1, 8, 4) | (((qh >> (4 * odd)) & 7) << 8)
    delta = torch.where(((qh >> (4 * odd)) & 8).bool(), -IQ1_DELTA, IQ1_DELTA).unsqueeze(-1)
    g = _table("iq1s_grid", b.device)[idx]
    torch.mul(dl, g + delta, out=out.view(-1, 8, 4, 8))


def _trits(q: torch.Tensor, n: int) -> torch.Tensor:
    """TQ1_0: (..., m) bytes -> (..., n, m) base-3 digits, most significant first, as ggml reads
    them: the byte times 3^i (mod 256), then its top "third" ((q * 3) >> 8)."""
    pow3 = torch.tensor([1, 3, 9, 27, 81], device=q.device)[:n].view(-1, 1)
    return (((q.unsqueeze(-2).long() * pow3) & 255) * 3) >> 8


def _tq1_0(b: torch.Tensor, out: torch.Tensor) -> None:
    xi = torch.cat(
        (_trits(b[:, 0:32], 5).flatten(1), _trits(b[:, 32:48], 5).flatten(1), _trits(b[:, 48:52], 4).flatten(1)), 1
    )
    torch.mul((xi - 1).float(), _f16(b, 52), out=out)


def _tq2_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = (b[:, 0:64].view(-1, 2, 1, 32).long() >> (2 * torch.arange(4, device=b.device)).view(1, 1, 4, 1)) & 3
    torch.mul((q - 1).float().flatten(1), _f16(b, 64), out=out)


KERNELS: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.MXFP4: _mxfp4,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
    T.IQ3_S: _iq3_s,
    T.IQ3_XXS: _iq3_xxs,
    T.IQ2_XXS: _iq2_xxs,
    T.IQ2_XS: _iq2_xs,
    T.IQ2_S: _iq2_s,
    T.IQ1_S: _iq1_s,
    T.IQ1_M: _iq1_m,
    T.TQ1_0: _tq1_0,
    T.TQ2_0: _tq2_0,
}
