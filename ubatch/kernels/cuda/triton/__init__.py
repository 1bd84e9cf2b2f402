"""Triton kernels of the CUDA backend (tested on the CPU in interpreter mode, compiled for sm_90 in CI)."""
