"""The CUDA backend: Triton kernels that read the weights as GGUF blocks, and the CUDA graphs
its decode steps are replayed from."""
