"""The forward pass as a graph: recorded once per ubatch shape, laid out in one workspace, bound
once to the backend's calls, run (or replayed by the backend's graph runner)."""
