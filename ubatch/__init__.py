"""ubatch: a llama.cpp-style runner that shows its work.

The Python API mirrors llama-cpp-python's high-level `Llama` class for the common calls.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# How long an OpenMP thread with no work spins before it sleeps. libgomp reads this once, when
# torch first loads it, so it is set here, before anything imports torch. Its default (300000
# rounds, about a millisecond) wins nothing on a quiet machine and costs most where a neighbour
# shares a core: a thread that spun out its time slice waits a whole slice behind the neighbour,
# and every kernel call waits for it, where a thread that slept is woken at once. Measured on a
# 2-vCPU Intel Xeon with one CPU hog beside `ubatch bench -t 2` (docs/backends.md): tg32 4.6-6.6
# -> 11.6-13.7 t/s, pp512 275 -> 479-488 t/s; quiet runs the same within their noise. A value the
# user set (GOMP_SPINCOUNT, or OMP_WAIT_POLICY) is kept.
SPIN_COUNT = "3000"
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT

if TYPE_CHECKING:
    from ubatch.llama import LLAMA_DEFAULT_SEED, Llama

__all__ = ["Llama", "LLAMA_DEFAULT_SEED"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `Llama` (and torch with it) loads on first use, so `ubatch tokenize` starts without torch
    if name in __all__:
        from ubatch import llama

        return getattr(llama, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
