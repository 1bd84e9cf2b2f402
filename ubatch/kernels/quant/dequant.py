"""Dequantise GGUF tensor bytes to float with vectorised torch ops (CPU or CUDA).

Why this exists: `gguf.quants.dequantize` is numpy-only and allocates several full-size
temporaries, so it is slow and cannot run on the GPU. Here every format is a handful of torch
ops over all blocks of a chunk at once (the non-linear and grid types in dequant_iq.py) (no Python loop over blocks or rows), and a large tensor
is processed a few million elements at a time into one preallocated output, so peak memory
stays near the size of the result.

Bit-exactness: each formula is computed in float32 in exactly the order of ggml's C reference
(and of `gguf.quants`), e.g. `(d*sc)*q - (dmin*m)` for K-quants and `d*q + m` for Q4_1/Q5_1,
with separate multiply and add (no fused multiply-add), so results match bit for bit. The
layouts are described in shared/reference/gguf-models.md section 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from ubatch.kernels.quant import dequant_iq

# Elements dequantised per step: large enough that per-op overhead is negligible, small enough
# that the uint8/float temporaries of one step stay a few MiB (cache-friendly on the CPU).
CHUNK_ELEMENTS = 1 << 20
_CHUNK_ELEMENTS_CUDA = 1 << 24

# A chunk step writes float32 blocks (n_blocks, block_size) from raw blocks (n_blocks, type_size).
_Kernel = Callable[[torch.Tensor, torch.Tensor], None]


def type_name(ggml_type: int) -> str:
    """Human name of a ggml type id (e.g. 12 -> "Q4_K"); "unknown" for ids gguf does not know."""
    try:
        return T(ggml_type).name
    except ValueError:
        return "unknown"


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """Little-endian half at byte `off` of every block, as float32 (n, 1).

    `.contiguous()` first: viewing a strided 2-byte slice as float16 needs even strides and
    offsets, which odd block sizes or an odd start offset would break; the copy is 2 B/block.
    """
    return b[:, off : off + 2].contiguous().view(torch.float16).float()


def _shifts(device: torch.device, *vals: int) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.uint8, device=device)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k, m) bytes -> (n, k, 2, m) 4-bit values: a run's low nibbles, then its high ones."""
    return torch.stack((qs & 15, qs >> 4), dim=-2)


def _bits(b: torch.Tensor, n_bits: int) -> torch.Tensor:
    """(n, m) bytes -> (n, n_bits, m): bit j of byte l at [.., j, l] (K-quant high-bit layout)."""
    return (b.unsqueeze(1) >> _shifts(b.device, *range(n_bits)).view(1, -1, 1)) & 1


def _crumbs(b: torch.Tensor) -> torch.Tensor:
    """(n, k, 32) bytes -> (n, k, 4, 32) 2-bit fields at shifts 0, 2, 4, 6 (Q2_K/Q3_K/Q6_K)."""
    return (b.unsqueeze(-2) >> _shifts(b.device, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 u32 `qh` (4 bytes) -> (n, 32) 5th bits: bit e of the u32 = bit e%8 of byte e//8."""
    return ((qh.unsqueeze(-1) >> _shifts(qh.device, *range(8))) & 1).flatten(1)


def _f32(x: torch.Tensor, bias: int = 0) -> torch.Tensor:
    """Small integer codes -> float32 minus `bias` (exact: all values are tiny integers)."""
    x = x.float()
    return x.sub_(bias) if bias else x


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(b[:, 2:].view(torch.int8), _f16(b, 0), out=out)  # int8 promotes exactly to f32


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _f32(_nibbles(b[:, 2:18].unsqueeze(1)).flatten(1), 8)
    torch.mul(_f16(b, 0), q, out=out)


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _f32(_nibbles(b[:, 4:20].unsqueeze(1)).flatten(1))
    torch.mul(_f16(b, 0), q, out=out).add_(_f16(b, 2))  # d*q + m: min is *added*


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 6:22].unsqueeze(1)).flatten(1) | (_q5_high(b[:, 2:6]) << 4)
    torch.mul(_f16(b, 0), _f32(q, 16), out=out)


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 8:24].unsqueeze(1)).flatten(1) | (_q5_high(b[:, 4:8]) << 4)
    torch.mul(_f16(b, 0), _f32(q), out=out).add_(_f16(b, 2))


def _q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    sc = b[:, 0:16]
    dl = (_f16(b, 80) * _f32(sc & 15)).unsqueeze(-1)  # (n, 16, 1)
    ml = (_f16(b, 82) * _f32(sc >> 4)).unsqueeze(-1)
    q = _f32(_crumbs(b[:, 16:80].view(-1, 2, 32)).view(-1, 16, 16))
    torch.mul(dl, q, out=out.view(-1, 16, 16)).sub_(ml)


def _q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    s = b[:, 96:108]
    low4 = _nibbles(s[:, :8].unsqueeze(1)).flatten(1)  # k<8: lo(S[k]); k>=8: hi(S[k-8])
    high2 = _crumbs(s[:, 8:12].unsqueeze(1)).flatten(1)  # k: S[8 + k%4] >> 2*(k//4)
    dl = (_f16(b, 108) * _f32(low4 | (high2 << 4), 32)).unsqueeze(-1)  # (n, 16, 1)
    lo2 = _crumbs(b[:, 32:96].view(-1, 2, 32)).view(-1, 16, 16).to(torch.int8)
    hb = _bits(b[:, 0:32], 8).view(-1, 16, 16).to(torch.int8)
    q = lo2.sub_((hb ^ 1) << 2)  # subtract 4 where the high bit is *clear*
    torch.mul(dl, q.float(), out=out.view(-1, 16, 16))


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12 packed bytes -> 8 six-bit scales and 8 six-bit mins, each (n, 8)."""
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 63, (mix & 15) | ((lo >> 6) << 4)), dim=1)
    m = torch.cat((hi & 63, (mix >> 4) | ((hi >> 6) << 4)), dim=1)
    return sc, m


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    sc, m = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * _f32(sc)).unsqueeze(-1)  # (n, 8, 1)
    ml = (_f16(b, 2) * _f32(m)).unsqueeze(-1)
    q = _f32(_nibbles(b[:, 16:144].view(-1, 4, 32)).view(-1, 8, 32))
    torch.mul(dl, q, out=out.view(-1, 8, 32)).sub_(ml)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    sc, m = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * _f32(sc)).unsqueeze(-1)
    ml = (_f16(b, 2) * _f32(m)).unsqueeze(-1)
    q = _nibbles(b[:, 48:176].view(-1, 4, 32)).view(-1, 8, 32) | (_bits(b[:, 16:48], 8) << 4)
    torch.mul(dl, _f32(q), out=out.view(-1, 8, 32)).sub_(ml)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    scales = b[:, 192:208].view(torch.int8)  # signed
    dl = (_f16(b, 208) * scales.float()).unsqueeze(-1)  # (n, 16, 1)
    low4 = _nibbles(b[:, 0:128].view(-1, 2, 64)).view(-1, 8, 32)  # g = 2*nibble + (byte//32)%2
    high2 = _crumbs(b[:, 128:192].view(-1, 2, 32)).view(-1, 8, 32)
    q = _f32(low4 | (high2 << 4), 32).view(-1, 16, 16)
    torch.mul(dl, q, out=out.view(-1, 16, 16))


_KERNELS: dict[int, _Kernel] = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    **dequant_iq.KERNELS,  # MXFP4, the IQ types, TQ1_0/TQ2_0
}
# Plain float formats: reinterpret the bytes; f16/bf16 -> f32 conversion is exact (bf16 is
# literally `u16 << 16`).
_FLOATS: dict[int, torch.dtype] = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}

SUPPORTED_TYPES: frozenset[int] = frozenset(int(t) for t in (*_FLOATS, *_KERNELS))


class UnsupportedTypeError(ValueError):
    """A tensor type no backend can read; the model loader turns it into a one-line error."""


def check_supported(ggml_type: int, what: str) -> None:
    """Raise UnsupportedTypeError naming `what` (e.g. a tensor name) if we cannot dequantise its type.

    Called at load time so that an unsupported model fails up front, not mid-generation.
    """
    if ggml_type not in SUPPORTED_TYPES:
        names = ", ".join(type_name(t) for t in sorted(SUPPORTED_TYPES))
        raise UnsupportedTypeError(
            f"{what}: tensor type {type_name(ggml_type)} (id {ggml_type}) is not supported; supported: {names}"
        )


def dequantize(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Turn a tensor's stored GGUF bytes into a new `shape` tensor of `dtype` on raw's device.

    `raw` is the contiguous uint8 data exactly as in the file (rows of blocks along the innermost
    dimension ne0, which is `shape[-1]`). Blocks never straddle rows, so the bytes are simply a
    sequence of blocks and can be chunked anywhere on a block boundary.
    """
    check_supported(ggml_type, f"tensor of shape {tuple(shape)}")
    if raw.dtype != torch.uint8:
        raise ValueError(f"dequantize expects uint8 bytes, got {raw.dtype}")
    block, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    n = math.prod(shape)
    if (shape and shape[-1] % block) or raw.numel() != n // block * type_size:
        raise ValueError(
            f"{type_name(ggml_type)} tensor of shape {tuple(shape)} needs {n // block * type_size} bytes in rows of {block}-element blocks; got {raw.numel()}"
        )
    raw = raw.reshape(-1)
    if ggml_type in _FLOATS:
        src = _FLOATS[ggml_type]
        if raw.storage_offset() % src.itemsize:  # a dtype view needs an aligned start
            raw = raw.clone()
        return raw.view(src).to(dtype, copy=True).view(shape)

    kernel = _KERNELS[ggml_type]
    out = torch.empty((n // block, block), dtype=dtype, device=raw.device)
    blocks = raw.view(-1, type_size)
    chunk = _CHUNK_ELEMENTS_CUDA if raw.device.type == "cuda" else CHUNK_ELEMENTS
    step = max(1, chunk // block)
    scratch = (
        None
        if dtype == torch.float32
        else torch.empty((min(step, len(blocks)), block), dtype=torch.float32, device=raw.device)
    )
    for i in range(0, len(blocks), step):
        b = blocks[i : i + step]
        if scratch is None:
            kernel(b, out[i : i + step])
        else:
            kernel(b, scratch[: len(b)])
            out[i : i + step].copy_(scratch[: len(b)])
    return out.view(shape)
