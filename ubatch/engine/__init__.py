"""Engine: GGUF loading, tokenizer, KV cache, batching, decoding. Returns data; never prints."""
