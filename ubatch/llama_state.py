"""`Llama.save_state` / `load_state` (llama-cpp-python's names) and their file variants.

The state is sequence 0's KV cells and tokens as engine/context/state.py captures them, in the
safetensors bytes of engine/context/state_file.py, plus the last logits row (llama-cpp-python
keeps `scores` with its state), so a restored `Llama` continues as if it had evaluated the
tokens. These functions take the context and the evaluated tokens; `Llama` keeps the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from ubatch.engine.context import state as seq_state
from ubatch.engine.context import state_file
from ubatch.engine.context.context import Context


@dataclass
class LlamaState:
    """llama-cpp-python's LlamaState: the evaluated tokens, the last logits, the cache bytes."""

    input_ids: np.ndarray
    scores: np.ndarray
    n_tokens: int
    llama_state: bytes
    llama_state_size: int
    seed: int


def capture(ctx: Context, tokens: list[int], last_logits: torch.Tensor, seed: int) -> LlamaState:
    """Sequence 0, holding `tokens`, with the logits row that followed them."""
    data = state_file.to_bytes(seq_state.capture(ctx, 0, tokens))
    last = last_logits.numpy().copy() if last_logits.numel() else np.zeros(0, dtype=np.single)
    return LlamaState(np.array(tokens, dtype=np.intc), last, len(tokens), data, len(data), seed)


def restore(ctx: Context, st: LlamaState, n_vocab: int) -> tuple[list[int], torch.Tensor | None]:
    """Put the state's cells back into sequence 0; (its tokens, its logits row, None when it
    holds none of this vocabulary's size). A state from another model or cache type is refused
    before anything changes."""
    parsed = state_file.from_bytes(bytes(st.llama_state), "state")
    seq_state.restore(ctx, parsed, 0)
    last = None
    if st.scores.size == n_vocab:
        last = torch.from_numpy(np.asarray(st.scores, dtype=np.single).copy())
    return parsed.tokens, last


def save_file(ctx: Context, tokens: list[int], path: str | os.PathLike[str]) -> int:
    """The state as a safetensors file (no logits: the next completion re-evaluates one token)."""
    return state_file.write_file(path, seq_state.capture(ctx, 0, tokens))


def load_file(ctx: Context, path: str | os.PathLike[str]) -> list[int]:
    """Restore sequence 0 from a file written by save_file; the tokens it holds."""
    parsed, _ = state_file.read_file(path)
    seq_state.restore(ctx, parsed, 0)
    return parsed.tokens
