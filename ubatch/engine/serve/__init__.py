"""The server's engine: slots, continuous batching, the scheduler, the engine loop and its door, tasks, prompt cache and side runners."""
