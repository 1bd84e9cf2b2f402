"""Build and load the CPU kernels (`kernels/cpu/csrc/`) for the CPU they run on.

The C files are compiled once per (source, compiler, CPU features) into the user cache directory
(`$XDG_CACHE_HOME/ubatch/kernels`, default ~/.cache), one compiler per file in parallel, and
loaded with ctypes; later starts only load the cached library. A cold build takes seconds, so a
front end may show it (`on_build`); the kernels never print. The build targets the
running CPU (`-march=native`), so an instruction the CPU lacks can never be emitted; the
library's cache key holds the CPU's feature flags, so a home directory shared between machines
never loads a library built for another CPU. Without AVX2+FMA+F16C the portable C path is
built instead (with a notice); without a C compiler there is no CPU backend and the context
falls back to the torch reference backend (with a notice).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from ubatch.kernels.cpu.program import check_arities
from ubatch.kernels.quant.dequant_iq import grid_raw

CSRC = Path(__file__).with_name("csrc")
ABI_VERSION = 21
FAST_FLAGS = ("avx2", "fma", "f16c")
# About how long a cold build takes, for the line a front end shows. The SIMD builds wait for
# their slowest file (matmul.c, 2.4 s alone on a 2-core AVX-512 Xeon; the whole build 4 s there,
# in parallel, 6 s one file after another); the portable build is plain C.
BUILD_SECONDS = {"native": 5, "avx2": 5, "portable": 1}

on_build: Callable[[str], AbstractContextManager[object]] | None = None
"""Set by a front end to show a cold build (the CLI: a status line on stderr). Called with one
line saying what is compiled and about how long it takes; the context manager it returns is held
while the compiler runs. Never called when the library is in the cache."""


@dataclass(slots=True)
class CpuLibrary:
    lib: ctypes.CDLL
    path: Path
    simd: str  # "avx512" (AVX-512F), "avx2" or "portable"
    built: bool  # compiled in this process (cold start) rather than loaded from the cache
    notice: str = ""
    amx: bool = False  # the AMX GEMM is built and Linux granted the process the tile state


def _amd_zen(family: int, model: int) -> str:
    """AMD's core generation from the x86 family and model numbers."""
    if family == 25:
        return "Zen 4" if 0x10 <= model < 0x20 or model >= 0x60 else "Zen 3"
    return {23: "Zen 1/2", 26: "Zen 5"}.get(family, "")


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name, as benchmarks record it. Cloud machines often report a bare name
    ("AMD EPYC", "Intel(R) Xeon(R) Processor"): AMD's core generation is then added, and for
    Intel, whose hypervisors may report any model number, the family and model as reported."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        text = ""
    for line in text.splitlines():  # the first processor's block
        key, _, value = line.partition(":")
        if not key.strip():
            break
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    if fields.get("vendor_id") == "AuthenticAMD" and family.isdigit() and model.isdigit() and "zen" not in name.lower():
        gen = _amd_zen(int(family), int(model))
        if gen:
            name += f" ({gen}, family {family} model {model})"
    elif fields.get("vendor_id") == "GenuineIntel" and name.rstrip().endswith("Processor") and "@" not in name:
        name += f" (family {family} model {model} as reported)"
    return name


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The running CPU's feature flags (read once: they do not change while the process runs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ubatch" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")


def _flags(portable: bool, no_avx512: bool = False) -> list[str]:
    base = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=c11"]
    if portable:
        return [*base, "-DUB_PORTABLE"]
    x86 = platform.machine() in ("x86_64", "AMD64")  # elsewhere there is no AVX-512 to leave out
    return [*base, "-march=native", *(["-mno-avx512f"] if no_avx512 and x86 else [])]


def _build(cc: str, portable: bool, no_avx512: bool = False) -> tuple[Path, bool, float]:
    files = sorted(CSRC.glob("*.[ch]"))
    src = b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    flags = _flags(portable, no_avx512)
    key = hashlib.sha256(
        b"\0".join(
            [
                src,
                version.encode(),
                " ".join(flags).encode(),
                " ".join(sorted(cpu_flags())).encode(),
                platform.machine().encode(),
            ]
        )
    ).hexdigest()[:16]
    kind = "portable" if portable else "avx2" if no_avx512 else "native"
    out = cache_dir() / f"cpu_kernels-{kind}-{key}.so"
    if out.exists():
        return out, False, 0.0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    t0 = time.perf_counter()
    sources = [f for f in files if f.suffix == ".c"]
    with on_build(_build_line(kind)) if on_build is not None else nullcontext():
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".build-{os.getpid()}-") as objdir:
            objs = [str(Path(objdir) / f"{f.stem}.o") for f in sources]
            cmds = [[cc, *flags, "-c", str(f), "-o", o] for f, o in zip(sources, objs)]
            # one compiler per file, as `make -j`: a cold start waits for the slowest file, not the sum
            with ThreadPoolExecutor(max_workers=min(len(cmds), os.cpu_count() or 1)) as pool:
                runs = list(pool.map(_compile, cmds))
            failed = next((r for r in runs if r.returncode != 0), None)
            if failed is None:
                failed = _compile([cc, *flags, *objs, "-o", str(tmp), "-lm"])
                failed = failed if failed.returncode != 0 else None
            if failed is not None:
                tmp.unlink(missing_ok=True)
                first = (failed.stderr.strip().splitlines() or ["no output"])[0]
                raise OSError(f"{cc} failed: {first}")
    tmp.replace(out)  # atomic: a concurrent first start never loads a half-written library
    return out, True, (time.perf_counter() - t0) * 1e3


def _compile(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _build_line(kind: str) -> str:
    """What a cold build compiles, for `on_build`: the SIMD level the library will have."""
    if kind == "portable":
        what = "the portable CPU kernels"
    else:
        simd = "avx512" if kind == "native" and "avx512f" in cpu_flags() else "avx2"
        simd = simd if platform.machine() in ("x86_64", "AMD64") else platform.machine()
        what = f"the CPU kernels for this CPU ({simd})"
    return f"compiling {what}, once: ~{BUILD_SECONDS[kind]} s"


def _bind(lib: ctypes.CDLL) -> None:
    c_i, c_l, c_p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.ub_abi_version.restype = c_i
    lib.ub_simd.restype = c_i
    lib.ub_gemv.argtypes = [c_i, c_p, c_l, c_l, c_l, c_p, c_l, c_l, c_p, c_l, c_p, c_i]
    lib.ub_gemv.restype = None
    lib.ub_gemv_scratch.argtypes = [c_i, c_l, c_l]
    lib.ub_gemv_scratch.restype = c_l
    lib.ub_vnni.restype = c_i
    lib.ub_set_gemv_path.argtypes = [c_i]
    lib.ub_set_gemv_path.restype = None
    lib.ub_dequant_rows.argtypes = [c_i, c_p, c_l, c_l, c_l, c_l, c_p, c_i]
    lib.ub_dequant_rows.restype = None
    lib.ub_get_rows.argtypes = [c_i, c_p, c_l, c_p, c_l, c_l, c_p, c_i]
    lib.ub_get_rows.restype = None
    c_f = ctypes.c_float
    lib.ub_rms_norm.argtypes = [c_p, c_l, c_p, c_l, c_l, c_f, c_p, c_l, c_i]
    lib.ub_rms_norm.restype = None
    lib.ub_rope.argtypes = [c_p, c_p, c_p, c_l, c_l, c_l, c_l, c_i, c_p, c_i]
    lib.ub_rope.restype = None
    lib.ub_attn.argtypes = [c_p, c_l, c_l, c_l, c_l, c_p, c_i, c_p, c_i, c_l, c_l, c_p, c_l, c_p, c_f, c_f, c_p, c_i]
    lib.ub_attn.restype = None
    lib.ub_gemm.argtypes = [c_i, c_p, c_l, c_l, c_l, c_p, c_l, c_l, c_p, c_l, c_p, c_i]
    lib.ub_gemm.restype = c_i
    lib.ub_gemm_scratch.argtypes = [c_i, c_l, c_l, c_i]
    lib.ub_gemm_scratch.restype = c_l
    lib.ub_gemm_amx.argtypes = lib.ub_gemm.argtypes
    lib.ub_gemm_amx.restype = c_i
    lib.ub_gemm_amx_scratch.argtypes = [c_l, c_i]
    lib.ub_gemm_amx_scratch.restype = c_l
    lib.ub_amx_init.restype = c_i
    lib.ub_mask_span.argtypes = [c_p, c_l, c_l, c_l, c_l, c_l]
    lib.ub_mask_span.restype = c_l
    lib.ub_softmax_tile.argtypes = [c_p, c_l, c_l, c_l, c_p, c_l, c_l, c_l, c_l, c_f, c_f, c_p, c_p, c_l, c_p, c_l, c_l, c_i]  # fmt: skip
    lib.ub_softmax_tile.restype = None
    lib.ub_attn_chunk.argtypes = [c_p, c_l, c_l, c_l, c_l, c_p, c_l, c_p, c_l, c_l, c_l, c_p, c_l, c_l, c_l, c_l, c_f, c_f]  # fmt: skip
    lib.ub_attn_chunk.argtypes += [c_p, c_p, c_l, c_p, c_l, c_p, c_i]
    lib.ub_attn_chunk.restype = c_i
    lib.ub_attn_chunk_scratch.argtypes = [c_l, c_l, c_l, c_i]
    lib.ub_attn_chunk_scratch.restype = c_l
    lib.ub_glu.argtypes = [c_p, c_p, c_l, c_i, c_p, c_i]
    lib.ub_add.argtypes = [c_p, c_p, c_l, c_p, c_i]
    lib.ub_scale.argtypes = [c_p, c_f, c_l, c_p, c_i]
    lib.ub_rows.argtypes = [c_p, c_p, c_l, c_l, c_p]
    lib.ub_kv_store.argtypes = [c_p, c_l, c_l, c_p, c_i, c_p]
    lib.ub_add_bias.argtypes = [c_p, c_p, c_l, c_l, c_p, c_i]
    lib.ub_softcap.argtypes = [c_p, c_f, c_l, c_l, c_p, c_i]
    lib.ub_lora.argtypes = [c_p, c_p, c_l, c_l, c_l, c_i, c_p, c_p, c_l, c_p, c_p, c_p, c_p, c_l, c_p, c_p, c_i]
    for f in (lib.ub_glu, lib.ub_add, lib.ub_scale, lib.ub_rows, lib.ub_kv_store, lib.ub_add_bias, lib.ub_softcap,
              lib.ub_lora):  # fmt: skip
        f.restype = None
    lib.ub_mul_mat_id.argtypes = [c_i, c_p, c_l, c_l, c_l, c_l, c_p, c_l, c_l, c_p, c_l, c_l, c_l, c_p, c_p, c_l, c_p, c_i]  # fmt: skip
    lib.ub_mul_mat_id_scratch.argtypes = [c_i, c_l, c_l, c_l, c_l, c_i]
    lib.ub_mul_mat_id_scratch.restype = c_l
    lib.ub_moe_topk.argtypes = [c_p, c_l, c_l, c_l, c_i, c_p, c_l, c_l, c_p]
    lib.ub_moe_weights.argtypes = [c_p, c_p, c_l, c_l, c_l, c_i, c_i, c_f, c_p]
    lib.ub_moe_sum.argtypes = [c_p, c_p, c_l, c_l, c_l, c_p, c_i]
    for f in (lib.ub_mul_mat_id, lib.ub_moe_topk, lib.ub_moe_weights, lib.ub_moe_sum):
        f.restype = None
    lib.ub_argmax_rows.argtypes = [c_p, c_l, c_l, c_l, c_p, c_i]
    lib.ub_argmax_rows.restype = None
    lib.ub_run.argtypes = [c_p, c_l]
    lib.ub_run.restype = c_l
    lib.ub_program_arity.argtypes = [c_i]
    lib.ub_program_arity.restype = c_i
    lib.ub_peak.argtypes = [c_i, c_i, ctypes.c_double, c_l]
    lib.ub_peak.restype = ctypes.c_double
    lib.ub_iq_init.argtypes = [c_p] * 6
    lib.ub_iq_init.restype = None


# the IQ types' grids as the C kernels read them (entries of 8 or 4 bytes), handed over once at
# load and kept alive here for as long as the process runs
_IQ_GRIDS = ("iq2xxs_grid", "iq2xs_grid", "iq2s_grid", "iq3xxs_grid", "iq3s_grid", "iq1s_grid")
_iq_tables: list[bytes] = []


def _init_iq(lib: ctypes.CDLL) -> None:
    if not _iq_tables:
        _iq_tables.extend(grid_raw(name) for name in _IQ_GRIDS)
    lib.ub_iq_init(*(ctypes.cast(ctypes.c_char_p(t), ctypes.c_void_p) for t in _iq_tables))


_LOADED: dict[tuple[bool, bool], CpuLibrary] = {}


def load(portable: bool | None = None, no_avx512: bool = False) -> CpuLibrary:
    """The kernel library for this CPU (built on first use); OSError if it cannot be had.

    `portable=None` picks the native build (AVX-512 where the CPU has AVX-512F, else AVX2) when
    the CPU has AVX2, FMA and F16C, else the portable one; UBATCH_CPU_PORTABLE=1 forces the
    portable build. `no_avx512` builds the AVX2 kernels even on an AVX-512 CPU (the `cpu-avx2`
    backend: both code paths stay tested and comparable on one machine).
    """
    notice = ""
    if portable is None:
        portable = os.environ.get("UBATCH_CPU_PORTABLE", "") not in ("", "0")
        if not portable and platform.machine() in ("x86_64", "AMD64"):
            missing = [f for f in FAST_FLAGS if f not in cpu_flags()]
            if missing:
                portable = True
                notice = (
                    f"CPU lacks {', '.join(missing)}: using the portable C kernels (slower; no illegal instructions)"
                )
        elif platform.machine() not in ("x86_64", "AMD64"):
            portable = True
    if (portable, no_avx512) in _LOADED:
        return _LOADED[portable, no_avx512]
    import torch  # noqa: F401  (its libgomp must be loaded first so that the kernels share it)

    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found (install gcc or set CC)")
    path, built, _ = _build(cc, portable, no_avx512)
    lib = ctypes.CDLL(str(path))
    _bind(lib)
    if lib.ub_abi_version() != ABI_VERSION:
        raise OSError(f"{path}: kernel ABI {lib.ub_abi_version()} != {ABI_VERSION}; delete it")
    check_arities(lib)
    _init_iq(lib)
    simd = {3: "avx512", 2: "avx2"}.get(lib.ub_simd(), "portable")
    amx = simd == "avx512" and lib.ub_amx_init() == 1  # asks Linux once, at load
    _LOADED[portable, no_avx512] = CpuLibrary(lib, path, simd, built, notice, amx)
    return _LOADED[portable, no_avx512]
