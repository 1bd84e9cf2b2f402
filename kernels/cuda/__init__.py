"""The CUDA backend: Triton kernels that read the weights as GGUF blocks."""
