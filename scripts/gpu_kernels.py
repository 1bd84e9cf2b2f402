"""Every op of the cuda backend against the torch reference, on random inputs, on one device.

Used by scripts/gpu_check.py on a lent GPU (real sizes) and in its CPU dry run (Triton's
interpreter, tiny sizes). One line per check: op, case, max |got - want| / max |want|, and
OK or FAIL against the op's tolerance (the gathers and cache writes must be bit-exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gpu_synth import random_blocks

from ubatch.kernels.ops import KV_CHUNK, AttentionArgs, KVTensor, attn_scratch
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.quantize import QUANTIZERS
from ubatch.kernels.quant.weight import QWeight
from ubatch.kernels.torch_ops import TorchOps


@dataclass
class Check:
    op: str
    case: str
    err: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.err <= self.tol

    def line(self) -> str:
        return f"{self.op:<10} {self.case:<34} {self.err:9.2e}  {'OK' if self.ok else 'FAIL'}"


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.double().cpu(), want.double().cpu()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - w).abs().max() / max(w.abs().max(), 1e-30))


def exact(got: torch.Tensor, want: torch.Tensor) -> float:
    return 0.0 if torch.equal(got.cpu().view(torch.uint8), want.cpu().view(torch.uint8)) else float("inf")


def run_checks(ops, dev: torch.device, tiny: bool, emit: Callable[[Check], None]) -> list[Check]:  # type: ignore[no-untyped-def]
    """All checks; `emit` sees each as it finishes."""
    ref, g = TorchOps(), torch.Generator().manual_seed(0)
    out: list[Check] = []

    def add(op: str, case: str, err: float, tol: float) -> None:
        out.append(Check(op, case, err, tol))
        emit(out[-1])

    def randn(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * s).to(dev)

    rng = np.random.default_rng(0)
    n, k = (96, 256) if tiny else (4096, 4096)
    for t in sorted(int(x) for x in ops._mm.SUPPORTED):
        w = QWeight(T(t).name, torch.from_numpy(random_blocks(rng, t, n, k)).reshape(-1).to(dev), t, (n, k))
        dense = dequantize(w.raw, t, w.shape).double()
        ops.prepare_weights([w])
        for m in (1, 7, 16, 17) if tiny else (1, 4, 16, 64, 512):
            x = randn(m, k)
            got = ops.linear(x, w, torch.empty(m, n, device=dev))
            add("linear", f"{T(t).name} m={m} {n}x{k}", rel(got, x.double() @ dense.t()), 1e-5)
        if t in ops._tg.GET_ROWS_TYPES or t == T.Q4_K:
            ids = torch.tensor([3, 0, n - 1, 3], device=dev)
            add(
                "get_rows", T(t).name, exact(ops.get_rows(w, ids, torch.empty(4, k, device=dev)), dense.float()[ids]), 0
            )
    rows, width = (5, 48) if tiny else (512, 2560)
    x, w, res = randn(rows, 3, width, s=100), randn(width), randn(rows, 3, width)
    sc = [torch.empty(rows, 3, 1, device=dev)]
    want = ref.rms_norm(x, w, 1e-6, torch.empty_like(x), sc)
    add("rms_norm", f"{rows}x3x{width}", rel(ops.rms_norm(x, w, 1e-6, torch.empty_like(x), sc), want), 1e-6)
    o, s = torch.empty_like(x), torch.empty_like(x)
    ops._te.rms_norm(x, w, 1e-6, o, res, s)
    add("norm+add", f"{rows}x3x{width}", max(rel(o, want), rel(s, res + want)), 1e-6)
    hd = 64 if tiny else 128
    q = randn(rows, 4, hd)
    cos, sin = ref.rope_cache(torch.arange(rows) * 37, hd, 10000.0, 1.0)
    cos, sin = cos.to(dev), sin.to(dev)
    for neox in (True, False):
        want = ref.rope(q, cos, sin, neox, torch.empty_like(q))
        add(
            "rope",
            f"{'neox' if neox else 'normal'} {rows}x4x{hd}",
            rel(ops.rope(q, cos, sin, neox, torch.empty_like(q)), want),
            1e-6,
        )
    a, b = randn(rows, width, s=4), randn(rows, width)
    for act in ("gelu_tanh", "silu"):
        add("glu", act, rel(ops.glu(a, b, act, torch.empty_like(a)), ref.glu(a, b, act, torch.empty_like(a))), 1e-6)
    add("add", f"{rows}x{width}", rel(ops.add(a, b, torch.empty_like(a)), a + b), 0)
    add("scale", f"{rows}x{width}", rel(ops.scale(a, 0.3, torch.empty_like(a)), a * 0.3), 0)
    add(
        "softcap",
        "30",
        rel(ops.softcap(a * 10, 30.0, torch.empty_like(a)), ref.softcap(a * 10, 30.0, torch.empty_like(a))),
        1e-6,
    )
    idx = torch.tensor([rows - 1, 0, 2], device=dev)
    add("rows", "3 rows", exact(ops.rows(a, idx, torch.empty(3, width, device=dev)), a[idx]), 0)
    for kv_type, gt in (("f16", T.F16), ("bf16", T.BF16), ("q8_0", T.Q8_0)):
        xs, cells = randn(rows, 2, hd), torch.randperm(rows * 2, generator=g)[:rows].to(dev)
        a_, b_ = _store(gt, rows * 2, hd, dev), _store(gt, rows * 2, hd, dev)
        ref.kv_store(a_, cells, xs)
        ops.kv_store(b_, cells, xs)
        add("kv_store", kv_type, exact(b_.data, a_.data), 0)
    out += _attention(ops, ref, dev, tiny, randn, add)
    return out


def _store(gt: int, cells: int, hd: int, dev: torch.device) -> KVTensor:
    """An empty 2-head cache of `cells` cells in type gt (F16, BF16 or Q8_0)."""
    if gt == T.Q8_0:
        return KVTensor(torch.zeros(cells, 2 * hd // 32 * 34, dtype=torch.uint8, device=dev), int(gt), 2, hd)
    dt = torch.float16 if gt == T.F16 else torch.bfloat16
    return KVTensor(torch.zeros(cells, 2, hd, dtype=dt, device=dev), int(gt), 2, hd)


def _attention(ops, ref, dev, tiny, randn, add) -> list:  # type: ignore[no-untyped-def]
    d, g, n_kv, size = (32, 2, 512, 640) if tiny else (128, 2, 4096, 4352)
    for kv_type in ("f16", "q8_0"):
        for h, hkv in ((4, 1), (8, 2), (4, 4)):
            for t in (1, 7) if tiny else (1, 8, 512):
                rows = randn(g * size, hkv, d)
                if kv_type == "q8_0":
                    k = KVTensor(QUANTIZERS[int(T.Q8_0)](rows.reshape(g * size, -1)), int(T.Q8_0), hkv, d)
                else:
                    k = KVTensor(rows.half(), int(T.F16), hkv, d)
                v = KVTensor(k.data.clone(), k.ggml_type, hkv, d)
                q = randn(g, t, h, d)
                vis = torch.rand(g, t, n_kv) > 0.3
                vis[:, :, n_kv // 2 + 10 :] = False
                vis[:, :, 0] = True
                mask = torch.where(vis, 0.0, float("-inf")).half().to(dev)
                starts = torch.tensor([0, size], device=dev)
                visible = (mask != float("-inf")).view(g * t, n_kv // KV_CHUNK, KV_CHUNK).any(2).any(0)
                sc = [torch.empty(s, dtype=dt, device=dev) for s, dt in attn_scratch(g, t, h, hkv, n_kv, d, d)]
                o = torch.empty(g * t, h * d, device=dev)
                want = ref.attention(AttentionArgs(q, k, v, starts.cpu(), n_kv, mask, 0.125, visible), o.clone(), sc)
                got = ops.attention(AttentionArgs(q, k, v, starts, n_kv, mask, 0.125, visible), o, sc)
                add("attention", f"{kv_type} h{h}/{hkv} t={t} n_kv={n_kv}", rel(got, want), 1e-5)
    return []
