"""A loaded model: hyperparameters, per-architecture tensor lists, weights, the bundled default model; `hf/` opens Hugging Face checkpoints."""
