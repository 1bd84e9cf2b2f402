"""Tensor parallelism over torch.distributed: starting the ranks, what they exchange, and the loop the other ranks run."""
