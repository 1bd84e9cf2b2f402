"""Compile every Triton kernel specialisation of the CUDA backend for the H200 (sm_90), no GPU needed.

The interpreter (TRITON_INTERPRET=1, used by the CPU tests) accepts code the real compiler
rejects, so CI also compiles each entry of `COMPILE_SPECS` in every module of
ubatch.kernels.cuda.triton that has one (format: the docstring of kernels/cuda/triton/matmul.py) down to
PTX and a cubin. One line per specialisation: OK/FAIL, name, constexprs, registers / spill stack
/ shared memory (cuobjdump's resource usage of the cubin, plus Triton's dynamic shared memory),
compile seconds. Exit 1 if any fails.

`--aligned` also compiles each entry as the JIT specialises it in the common case: every pointer
and integer argument divisible by 16 (torch's allocations, even shapes), which turns on vector
loads and cp.async pipelining, a different code path from the generic one.

    python scripts/triton_compile_check.py [--match SUBSTR ...] [--aligned] [--jobs N] [--fresh-cache]
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler path, never the interpreter

import argparse  # noqa: E402
import importlib  # noqa: E402
import pkgutil  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

PACKAGE = "ubatch.kernels.cuda.triton"
ARCH, WARP = 90, 32


@dataclass
class Result:
    name: str
    consts: str
    ok: bool
    seconds: float
    usage: str  # "regs=.. stack=.. smem=.." or the error's first line


def _modules() -> list[str]:
    pkg = importlib.import_module(PACKAGE)
    names = [f"{PACKAGE}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    return [n for n in names if hasattr(importlib.import_module(n), "COMPILE_SPECS")]


def _specs(module: str) -> list[tuple]:
    return list(importlib.import_module(module).COMPILE_SPECS)


def _usage(cubin: bytes, shared: int) -> str:
    """Registers and spill stack per thread from cuobjdump, when Triton ships it."""
    from triton.backends.nvidia import compiler as nv  # noqa: PLC0415

    try:
        tool = nv.get_cuobjdump_path() if hasattr(nv, "get_cuobjdump_path") else None
    except Exception:  # noqa: BLE001 - a missing tool only loses the register column
        tool = None
    tool = tool or str(Path(nv.__file__).parent / "bin" / "cuobjdump")
    regs = "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if m:
        regs = f"regs={m.group(1)} stack={m.group(2)}"
    return f"{regs} smem={shared}"


def _aligned_attrs(signature: dict[str, str]) -> dict[tuple[int, ...], list[list[object]]]:
    """Divisibility-by-16 hints on every pointer and integer argument (what the JIT adds)."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, ty in enumerate(signature.values())
        if ty[0] == "*" or ty in ("i32", "i64")
    }


def compile_one(module: str, index: int, aligned: bool = False) -> Result:
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    spec = _specs(module)[index]
    name, fn, signature, consts = spec[:4]
    options = spec[4] if len(spec) > 4 else {}
    shown = ",".join(f"{k}={v}" for k, v in consts.items())
    name = f"{name} aligned" if aligned else name
    t0 = time.perf_counter()
    try:
        src = triton.compiler.ASTSource(fn, signature, consts, attrs=_aligned_attrs(signature) if aligned else None)
        kernel = triton.compile(src, target=GPUTarget("cuda", ARCH, WARP), options=dict(options))
        if not kernel.asm.get("cubin"):
            raise RuntimeError("no cubin produced")
        usage = _usage(kernel.asm["cubin"], kernel.metadata.shared)
        return Result(name, shown, True, time.perf_counter() - t0, usage)
    except Exception as e:  # noqa: BLE001 - every failure is reported, the run goes on
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return Result(name, shown, False, time.perf_counter() - t0, f"{type(e).__name__}: {first[:200]}")


def _run(job: tuple[str, int, bool]) -> Result:
    return compile_one(*job)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--match", action="append", default=[], help="only specs whose name contains this (repeatable)")
    ap.add_argument("--aligned", action="store_true", help="also compile the aligned specialisation of each")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes")
    ap.add_argument("--fresh-cache", action="store_true", help="compile into an empty cache (real compile times)")
    args = ap.parse_args(argv)
    if args.fresh_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    jobs = []
    for module in _modules():
        for i, spec in enumerate(_specs(module)):
            if not args.match or any(s in spec[0] for s in args.match):
                jobs += [(module, i, False)] + ([(module, i, True)] if args.aligned else [])
    if not jobs:
        print("no kernel specialisations matched", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_run, jobs))
    else:
        results = [_run(j) for j in jobs]
    for r in results:
        print(f"{'OK  ' if r.ok else 'FAIL'} {r.name:<52} {r.consts:<48} {r.usage:<28} {r.seconds:6.2f}s", flush=True)
    failed = sum(not r.ok for r in results)
    total = time.perf_counter() - t0
    print(f"{len(results) - failed}/{len(results)} compiled for sm_{ARCH} in {total:.1f}s ({failed} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
