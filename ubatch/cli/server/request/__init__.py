"""Request bodies read into the engine's task parameters: llama-server's native schema, OpenAI's, chat messages, grammars, samplers."""
