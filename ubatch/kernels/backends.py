"""The registry of op backends: the engine asks for one by name and never builds one itself.

`torch` is the reference (dense f32 copies, any device); `cpu` computes from the GGUF blocks
with the C kernels (`cpu-portable` forces their portable build, `cpu-avx2` their 256-bit one on an
AVX-512 CPU, `cpu-noamx` the f32 FMA GEMM where `cpu` would use AMX tiles); `auto` takes the fastest one
that can run here and says why when it has to fall back: on an AVX-512 CPU, decode's and
prefill's kernels each from the build measured faster for them (kernels/cpu/dispatch.py), where
`cpu` always runs the native build. `cuda` runs the Triton kernels on the
GPU (kernels/cuda/ops.py); `--device` (cli/device.py) chooses it.
"""

from __future__ import annotations

from collections.abc import Callable

from ubatch.kernels.ops import Ops

_FACTORIES: dict[str, Callable[[int], Ops]] = {}


class BackendError(ValueError):
    """An unknown backend name, or one that cannot run on this machine."""


def register(name: str, factory: Callable[[int], Ops]) -> None:
    _FACTORIES[name] = factory


def names() -> list[str]:
    return ["auto", *_FACTORIES]


def create(name: str = "auto", n_threads: int = 1) -> Ops:
    """A backend by name; `auto` falls back to the torch reference with a notice."""
    if name == "auto":
        try:
            return _cpu(n_threads, measured=True)
        except OSError as e:
            ops = _FACTORIES["torch"](n_threads)
            ops.notices.append(
                f"CPU kernels unavailable ({e}): using the torch reference backend (dense f32 weights, slower)"
            )
            return ops
    if name not in _FACTORIES:
        raise BackendError(f"unknown backend {name!r}; use one of {', '.join(names())}")
    try:
        return _FACTORIES[name](n_threads)
    except OSError as e:
        raise BackendError(f"backend {name!r} cannot run here: {e}") from None


def _torch(n: int) -> Ops:
    from ubatch.kernels.torch_ops import TorchOps

    return TorchOps(n)


def _cpu(
    n: int, portable: bool | None = None, no_avx512: bool = False, no_amx: bool = False, measured: bool = False
) -> Ops:
    from ubatch.kernels.cpu.ops import CpuOps

    return CpuOps(n, portable, no_avx512, no_amx, measured)


def _cuda(n: int) -> Ops:
    try:
        from ubatch.kernels.cuda.ops import create as create_cuda
    except ImportError as e:  # a GPU without Triton: say what to install, in one line
        raise BackendError(f"backend 'cuda' needs Triton ({e}); pip install 'ubatch[cuda]'") from None
    return create_cuda(n)


register("torch", _torch)
register("cpu", _cpu)
register("cpu-portable", lambda n: _cpu(n, portable=True))
register("cpu-avx2", lambda n: _cpu(n, portable=False, no_avx512=True))  # the 256-bit kernels, even with AVX-512
register("cpu-noamx", lambda n: _cpu(n, no_amx=True))  # the f32 FMA GEMM, even with AMX
register("cuda", _cuda)  # Triton kernels on the GPU (kernels/cuda/ops.py); cli/device.py picks it
