"""`ubatch server`: llama-server's flags, HTTP layer, streams, logs and metrics over the engine's scheduler."""
