"""llama.cpp command lines: every flag of each llama.cpp tool, what ubatch does with it, and the compatibility table."""
