"""One sequence's generation (sampling, grammar, stop strings, streaming text) and embedding pooling."""
