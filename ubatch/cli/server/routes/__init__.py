"""The routes of `ubatch server`, grouped as llama-server groups them."""
