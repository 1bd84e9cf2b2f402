"""Speculative decoding: parameters, drafters (n-gram lookup, a draft model) and verification of a draft by the target."""
