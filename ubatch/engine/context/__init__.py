"""A context: the model plus its KV memory, decoding batches ubatch by ubatch; its reservation, memory plan and saved sequence state."""
