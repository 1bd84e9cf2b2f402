"""ubatch: a llama.cpp-style runner that shows its work.

The Python API mirrors llama-cpp-python's high-level `Llama` class for the common calls.
"""

from .llama import LLAMA_DEFAULT_SEED, Llama

__all__ = ["Llama", "LLAMA_DEFAULT_SEED"]
__version__ = "0.1.0"
