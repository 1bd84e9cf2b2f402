"""The SPM tokenizer exactly as llama.cpp runs it, and streaming detokenisation."""
