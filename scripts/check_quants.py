"""Every block type ubatch reads beyond the K-quants, against llama.cpp's own code.

    python scripts/check_quants.py [--blocks 4096] [--lib PATH/libggml-base.so]

Per type: random blocks (every byte random, so NaN/Inf scales and every code are covered, except
that the CPU kernels' rows get finite scales), dequantised by libggml's `dequantize_row_*` (the
llama.cpp build's libggml-base.so), by the torch reference (kernels/quant/dequant.py) and by the C
kernels of each CPU build (`ub_dequant_rows`, what the GEMM packs its panels from); the counts of
values whose bits differ. Then the GEMV (1 and 8 rows of x) against x times the dequantised
weights in float64: max |error| / max |reference|. Prints a Markdown table; exit status 1 on any
differing bit.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from ubatch.kernels.cpu.build import load
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.dequant_iq import KERNELS

LIB = Path.home() / ".cache/ubatch-yardstick/build/bin/libggml-base.so"
F16_AT = {T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ3_S: (0,), T.IQ3_XXS: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,)}
F16_AT |= {T.IQ2_S: (0,), T.IQ1_S: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,), T.MXFP4: (), T.IQ1_M: ()}


def finite(t: T, raw: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The same blocks with small finite scales (the products of a GEMV compare only then)."""
    raw = raw.copy()
    for off in F16_AT[t]:
        raw[:, off : off + 2] = rng.uniform(-0.05, 0.05, (len(raw), 1)).astype(np.float16).view(np.uint8)
    if t == T.MXFP4:
        raw[:, 0] = rng.integers(118, 128, len(raw))
    if t == T.IQ1_M:
        raw[:, 55] &= 0xBF
    return raw


def ggml_rows(lib: ctypes.CDLL, t: T, raw: np.ndarray) -> np.ndarray:
    block, _ = GGML_QUANT_SIZES[t]
    out = np.zeros(len(raw) * block, np.float32)
    fn = getattr(lib, f"dequantize_row_{t.name.lower()}")
    fn(raw.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(out.size))
    return out


def differing(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.count_nonzero(a.view(np.int32) != b.view(np.int32)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--lib", type=Path, default=LIB)
    a = ap.parse_args()
    if not a.lib.exists():
        raise SystemExit(f"{a.lib}: no libggml-base.so (build llama.cpp: ../shared/tools/llama-cpp.sh)")
    ggml = ctypes.CDLL(str(a.lib))
    builds = {
        name: load(portable=name == "portable", no_avx512=name == "avx2") for name in ("native", "avx2", "portable")
    }
    head = " | ".join(f"C {n} bits / GEMV err" for n in builds)
    print(f"| type | values | torch reference: differing bits | {head} |")
    print("|---|---|---|" + "---|" * len(builds))
    bad = 0
    rng = np.random.default_rng(0)
    for t in (T(int(k)) for k in KERNELS):
        block, size = GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, (a.blocks, size), dtype=np.uint8)
        want = ggml_rows(ggml, t, raw)
        ref = differing(dequantize(torch.from_numpy(raw.copy()), t, (want.size,)).numpy(), want)
        k = 2048
        rows = finite(t, raw, rng).reshape(-1, k // block * size)
        n = len(rows)
        w = torch.from_numpy(rows.copy())
        want_rows = ggml_rows(ggml, t, rows.reshape(-1, size)).reshape(n, k)
        x = torch.randn(8, k, generator=torch.Generator().manual_seed(1))
        cells = []
        for lib in builds.values():
            out = torch.empty(n, k)
            lib.lib.ub_dequant_rows(int(t), w.data_ptr(), w.shape[1], 0, n, k, out.data_ptr(), 2)
            bits = differing(out.numpy(), want_rows)
            err = 0.0
            for m in (1, 8):
                y = torch.empty(m, n)
                lib.lib.ub_gemv(int(t), w.data_ptr(), w.shape[1], n, k, x.data_ptr(), m, k, y.data_ptr(), n, None, 2)
                ref64 = x[:m].double() @ torch.from_numpy(want_rows).double().T
                err = max(err, float((y.double() - ref64).abs().max() / ref64.abs().max()))
            bad += bits
            cells.append(f"{bits} / {err:.1e}")
        bad += ref
        print(f"| {t.name} | {want.size} | {ref} | " + " | ".join(cells) + " |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
