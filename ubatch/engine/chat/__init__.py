"""Chat templates: messages -> the prompt text a model was trained on, rendered in a Jinja sandbox or by the hand-written formats."""
