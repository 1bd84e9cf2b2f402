"""`ubatch cli`: one-shot completion, llama-completion's interactive mode and the terminal chat."""
