"""`ubatch bench` (llama-bench) and `ubatch batched-bench` (llama-batched-bench): parameters, runs, system info, formats and plots."""
