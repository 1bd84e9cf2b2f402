"""Triton kernels under test: compiled on a GPU, in Triton's interpreter without one.

Import this before any kernel module (kernels/triton/mode.py says why: the choice is made when a
kernel is decorated; modules imported earlier are reloaded). `DEVICE` is where test tensors go.
"""

from __future__ import annotations

from ubatch.kernels.cuda.triton import mode

INTERPRETED = mode.use_interpreter_without_gpu()
DEVICE = "cpu" if INTERPRETED else "cuda"
