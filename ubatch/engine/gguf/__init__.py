"""GGUF files: the memory-mapped container, typed metadata reads and string arrays."""
