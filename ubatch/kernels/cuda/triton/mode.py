"""Compiled or interpreted: Triton picks the interpreter when a kernel is *decorated* (it reads
TRITON_INTERPRET then), so the choice is made before the kernel modules are imported, or they
are reloaded.

Without a CUDA GPU the `cuda` backend runs its kernels in Triton's interpreter on CPU tensors
(tests, dry runs of scripts/gpu_check.py), so the whole backend can be checked on any machine.
The kernel modules themselves never set the variable: scripts/triton_compile_check.py compiles
them for sm_90 on a machine without a GPU.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Protocol

import torch

# helpers first: a kernel calls the jit functions its module imported
KERNEL_MODULES = ("quant_tiles", "matmul", "gather", "elementwise", "attention", "lora")


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_interpreter_without_gpu() -> bool:
    """Switch to the interpreter when there is no CUDA GPU; True when the kernels interpret."""
    if torch.cuda.is_available() and not interpreted():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    _shim_numpy_scalars()
    from triton.runtime.jit import JITFunction

    pkg = __name__.rsplit(".", 1)[0]
    loaded = [sys.modules[f"{pkg}.{m}"] for m in KERNEL_MODULES if f"{pkg}.{m}" in sys.modules]
    if any(isinstance(v, JITFunction) for m in loaded for v in vars(m).values()):
        for m in loaded:
            importlib.reload(m)
    return True


class _Scope(Protocol):
    """What the interpreter's patching scope offers (triton.runtime.interpreter)."""

    def set_attr(self, obj: object, name: str, value: object) -> None: ...


def _shim_numpy_scalars() -> None:
    """triton 3.6's interpreter hands a runtime loop bound (`range(0, n, BLOCK)`) to int() as a
    1-element array, which numpy >= 2.4 refuses; read the one element instead."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_ubatch_shimmed", False):
        return
    original = interp._patch_lang_tensor

    def patch(tensor: object, scope: _Scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch
    interp._ubatch_shimmed = True
