"""Hugging Face checkpoints read as the GGUF file their conversion would give, and written as one."""
