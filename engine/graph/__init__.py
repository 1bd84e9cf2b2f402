"""The forward pass as a graph: recorded once per ubatch shape, laid out in one workspace, run (or replayed as a CUDA graph)."""
