"""The fast CPU backend: C kernels built for the CPU they run on, bound once per graph node and fused into programs."""
