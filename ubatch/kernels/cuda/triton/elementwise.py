"""Triton kernels for the row-wise and element-wise ops of a layer: RMSNorm (optionally fused
with the residual add that follows gemma's post-norms), RoPE (NEOX and normal pairs), the gated
activation and scale / add / softcap (the row gather of the output rows is gather.py's).

Each kernel is one launch over contiguous f32 rows; the wrappers check nothing the backend has
not already checked (kernels/cuda/ops.py falls back to torch for odd layouts). `COMPILE_SPECS`
lists every specialisation the backend launches, for scripts/triton_compile_check.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEM_BLOCK = 1024  # elements per program of the flat element-wise kernels
OP_ADD, OP_SCALE, OP_SOFTCAP, OP_BIAS = 0, 1, 2, 3


@triton.jit
def _tanh(x):
    """tanh through the sigmoid (no tanh in triton.language): 2·σ(2x) - 1."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def rms_norm_kernel(X, W, Y, R, S, n, stride_x, stride_y, stride_r, eps, BLOCK: tl.constexpr, ADD: tl.constexpr):
    """Row i: y = x / sqrt(mean(x²) + eps) · w; with ADD also s = r + y (the residual add)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n
    x = tl.load(X + row * stride_x + c, mask=m, other=0.0)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = x * inv * tl.load(W + c, mask=m, other=0.0)
    tl.store(Y + row * stride_y + c, y, mask=m)
    if ADD:
        r = tl.load(R + row * stride_r + c, mask=m, other=0.0)
        tl.store(S + row * stride_r + c, r + y, mask=m)


@triton.jit
def rope_kernel(
    X, COS, SIN, Y, n_head, d, half, sx_t, sx_h, sy_t, sy_h, NEOX: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr
):
    """Token t: rotate the first 2·half dims of every head by the token's angles (NEOX pairs
    (i, i + half), normal pairs (2i, 2i + 1)); dims past 2·half are copied."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BH)[:, None]
    i = tl.arange(0, BD)[None, :]
    hm = h < n_head
    rot = hm & (i < half)
    c = tl.load(COS + t * half + i, mask=i < half, other=1.0)
    s = tl.load(SIN + t * half + i, mask=i < half, other=0.0)
    if NEOX:
        ia, ib = i, i + half
    else:
        ia, ib = 2 * i, 2 * i + 1
    xa = tl.load(X + t * sx_t + h * sx_h + ia, mask=rot, other=0.0)
    xb = tl.load(X + t * sx_t + h * sx_h + ib, mask=rot, other=0.0)
    tl.store(Y + t * sy_t + h * sy_h + ia, xa * c - xb * s, mask=rot)
    tl.store(Y + t * sy_t + h * sy_h + ib, xa * s + xb * c, mask=rot)
    tail = hm & (i < d - 2 * half)  # unrotated dims (n_rot < head_dim)
    xt = tl.load(X + t * sx_t + h * sx_h + 2 * half + i, mask=tail, other=0.0)
    tl.store(Y + t * sy_t + h * sy_h + 2 * half + i, xt, mask=tail)


@triton.jit
def glu_kernel(G, U, Y, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """y = act(gate) · up, act GELU (tanh approximation) or SiLU."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(G + i, mask=m, other=0.0)
    u = tl.load(U + i, mask=m, other=0.0)
    if GELU:
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        a = g * tl.sigmoid(g)
    tl.store(Y + i, a * u, mask=m)


@triton.jit
def unary_binary_kernel(A, B, Y, n, ncol, s, OP: tl.constexpr, BLOCK: tl.constexpr):
    """OP_ADD: a + b; OP_SCALE: a · s; OP_SOFTCAP: tanh(a / s) · s; OP_BIAS: a + b[i % ncol] (a
    projection's bias on each of its rows of ncol values)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(A + i, mask=m, other=0.0)
    if OP == 0:
        y = a + tl.load(B + i, mask=m, other=0.0)
    elif OP == 3:
        y = a + tl.load(B + i % ncol, mask=m, other=0.0)
    elif OP == 1:
        y = a * s
    else:
        y = _tanh(a / s) * s
    tl.store(Y + i, y, mask=m)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def rms_norm(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    res: torch.Tensor | None = None,
    res_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x, out: contiguous (..., n); with `res`, `res_out = res + out` in the same pass."""
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out
    add = res is not None
    r, s = (res, res_out) if add else (x, out)
    rms_norm_kernel[(rows,)](x, w, out, r, s, n, n, n, n, eps, BLOCK=_pow2(n), ADD=add)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool, out: torch.Tensor) -> torch.Tensor:
    """x, out: (n, heads, d) with unit stride in d; cos, sin: contiguous (n, half)."""
    n, h, d = x.shape
    half = cos.shape[1]
    if n == 0:
        return out
    bd = _pow2(max(half, d - 2 * half))
    rope_kernel[(n,)](
        x, cos, sin, out, h, d, half, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        NEOX=neox, BH=_pow2(h), BD=bd,
    )  # fmt: skip
    return out


def glu(gate: torch.Tensor, up: torch.Tensor, act: str, out: torch.Tensor) -> torch.Tensor:
    n = gate.numel()
    if n:
        glu_kernel[(triton.cdiv(n, ELEM_BLOCK),)](gate, up, out, n, GELU=act == "gelu_tanh", BLOCK=ELEM_BLOCK)
    return out


def elementwise(op: int, a: torch.Tensor, b: torch.Tensor | None, s: float, out: torch.Tensor) -> torch.Tensor:
    """Contiguous a, out (and b: a's shape, or with OP_BIAS one row of a's last dimension)."""
    n = a.numel()
    if n:
        grid = (triton.cdiv(n, ELEM_BLOCK),)
        ncol = a.shape[-1] if a.dim() else 1
        unary_binary_kernel[grid](a, a if b is None else b, out, n, ncol, float(s), OP=op, BLOCK=ELEM_BLOCK)
    return out


_F = "*fp32"
COMPILE_SPECS = [
    *[
        ("rms_norm", rms_norm_kernel,
         {"X": _F, "W": _F, "Y": _F, "R": _F, "S": _F, "n": "i32", "stride_x": "i32", "stride_y": "i32",
          "stride_r": "i32", "eps": "fp32", "BLOCK": "constexpr", "ADD": "constexpr"},
         {"BLOCK": b, "ADD": add})
        for b in (32, 256, 1024, 4096) for add in (False, True)
    ],
    *[
        ("rope", rope_kernel,
         {"X": _F, "COS": _F, "SIN": _F, "Y": _F, "n_head": "i32", "d": "i32", "half": "i32", "sx_t": "i32",
          "sx_h": "i32", "sy_t": "i32", "sy_h": "i32", "NEOX": "constexpr", "BH": "constexpr", "BD": "constexpr"},
         {"NEOX": neox, "BH": bh, "BD": bd})
        for neox in (False, True) for bh in (1, 4, 8, 32) for bd in (16, 64, 128)
    ],
    *[
        ("glu", glu_kernel, {"G": _F, "U": _F, "Y": _F, "n": "i32", "GELU": "constexpr", "BLOCK": "constexpr"},
         {"GELU": g, "BLOCK": ELEM_BLOCK})
        for g in (False, True)
    ],
    *[
        ("elementwise", unary_binary_kernel,
         {"A": _F, "B": _F, "Y": _F, "n": "i32", "ncol": "i32", "s": "fp32", "OP": "constexpr", "BLOCK": "constexpr"},
         {"OP": op, "BLOCK": ELEM_BLOCK})
        for op in (OP_ADD, OP_SCALE, OP_SOFTCAP, OP_BIAS)
    ],
]  # fmt: skip
