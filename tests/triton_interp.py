"""Triton's interpreter mode for the kernel tests: import this before anything imports triton kernels.

`triton.jit` picks the interpreter when the kernel is *decorated*, so TRITON_INTERPRET must be
set before a kernel module is first imported; `interpreted(...)` reloads modules that were
imported earlier without it (another test importing the CUDA backend, say), in the order given
(helpers first: a kernel calls the helper functions its module imported).

Shim: triton 3.6's interpreter turns a runtime scalar into a 1-element numpy array and calls
int() on it for `range(0, K, BLOCK)`; numpy >= 2.4 refuses that (only 0-d arrays convert), so
every kernel with a loop over a runtime bound fails. The shim reads the one element instead.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

os.environ["TRITON_INTERPRET"] = "1"

import triton.runtime.interpreter as _interp  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_original_patch = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:  # type: ignore[no-untyped-def]
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_lang_tensor


def interpreted(*modules: ModuleType) -> None:
    """Make every kernel of `modules` an interpreted one (reloading them if any was compiled)."""
    if any(isinstance(v, JITFunction) for m in modules for v in vars(m).values()):
        for m in modules:
            importlib.reload(m)
