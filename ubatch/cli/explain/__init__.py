"""`ubatch explain`: a request run for real, then how it was batched, split, padded and masked."""
