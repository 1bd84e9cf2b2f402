"""Weights as stored in GGUF: quantised bytes and their type, dequantisation, quantisation and backend repacks."""
