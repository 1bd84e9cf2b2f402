"""Compute ops behind one interface (torch reference; Triton later)."""
