"""The decode GEMV alone on a model's real matrices: each path of this build, alternating, in one run.

    python scripts/bench_gemv.py [-m MODEL] [-t 1,2] [--rows 1,4,16] [--layer 0] [-r 5] [--backend cpu]

For every matrix of one layer and the output head (or --tensors NAME,...), `ub_gemv` is called
with random x on the stored blocks, per path: `all` (every kernel the build has: on AVX-512 the
K-quants' integer GEMV, csrc/gemv_vnni.c) and `f32` (the build without it: AVX-512's f32 GEMV,
AVX2's 16-bit x), alternating over -r rounds; the best time of each is printed with the weight
bytes it streams per second (GB/s: the matrix as stored / time; rows of x share one pass).
Threads come from the same OpenMP pool the engine uses.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from ubatch.engine.model.default_model import default_model_path
from ubatch.kernels.cpu.build import cpu_model, load

PATHS = {"all": 0, "f32": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--tensors", default="", help="comma-separated tensor names (default: one layer and the head)")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cpu-avx2"])
    a = ap.parse_args()
    path = a.model or str(default_model_path())
    lib = load(no_avx512=a.backend == "cpu-avx2")
    reader = GGUFReader(path)
    names = a.tensors.split(",") if a.tensors else None
    tensors = [
        t
        for t in reader.tensors
        if len(t.shape) == 2
        and (t.name in names if names else t.name.startswith(f"blk.{a.layer}.") or t.name == "output.weight")
    ]
    if not names and not any(t.name == "output.weight" for t in tensors):  # tied head
        tensors += [t for t in reader.tensors if t.name == "token_embd.weight"]
    print(f"# {cpu_model()}; library {lib.simd}; model {path}")
    print("| tensor | type | n x k | threads | rows | path | us | GB/s | f32/all |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in tensors:
        k, n = int(t.shape[0]), int(t.shape[1])
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
        row_bytes = raw.size // n
        for nth in (int(v) for v in a.threads.split(",")):
            for m in (int(v) for v in a.rows.split(",")):
                x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                y = np.empty((m, n), np.float32)
                best = {p: float("inf") for p in PATHS}
                reps = max(1, int(2e7 // max(raw.size, 1)))
                for _ in range(a.rounds):
                    for p, code in PATHS.items():
                        lib.lib.ub_set_gemv_path(code)
                        need = int(lib.lib.ub_gemv_scratch(int(t.tensor_type), m, k))
                        scratch = np.empty(max(need, 1), np.float32)
                        args = (int(t.tensor_type), raw.ctypes.data, row_bytes, n, k, x.ctypes.data, m, k)
                        tail = (y.ctypes.data, n, scratch.ctypes.data, nth)
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            lib.lib.ub_gemv(*args, *tail)
                        best[p] = min(best[p], (time.perf_counter() - t0) / reps)
                lib.lib.ub_set_gemv_path(0)
                for p in PATHS:
                    ratio = f"{best['f32'] / best['all']:.2f}x" if p == "all" else ""
                    gbs = raw.size / best[p] / 1e9
                    print(
                        f"| {t.name} | {T(t.tensor_type).name} | {n} x {k} | {nth} | {m} | {p} "
                        f"| {best[p] * 1e6:.1f} | {gbs:.1f} | {ratio} |"
                    )
    _ = ctypes  # the library's functions are ctypes ones (load binds them)


if __name__ == "__main__":
    main()
