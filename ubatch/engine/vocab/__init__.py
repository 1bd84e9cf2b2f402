"""Every tokenizer llama.cpp reads (SPM, BPE with its pre-tokenisers, WordPiece, Unigram), exactly
as it runs them, and streaming detokenisation."""
