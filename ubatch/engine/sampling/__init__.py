"""llama.cpp's sampler chain: its stages, DRY, Mirostat, the stage names and the random draws."""
