"""ubatch: a llama.cpp-style runner that shows its work.

The Python API mirrors llama-cpp-python's high-level `Llama` class for the common calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
