"""Driving a context to a result: one completion (prefill, then decode token by token) and a chat conversation on one sequence."""
