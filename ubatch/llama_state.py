"""`Llama.save_state` / `load_state` (llama-cpp-python's names) and their file variants.

The state is sequence 0's KV cells and tokens as `engine/state.py` captures them, in the
safetensors bytes of `engine/state_file.py`, plus the last logits row (llama-cpp-python keeps
`scores` with its state), so a restored `Llama` continues as if it had evaluated the tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ubatch.engine.context import state as seq_state
from ubatch.engine.context import state_file

if TYPE_CHECKING:
    from ubatch.llama import Llama


@dataclass
class LlamaState:
    """llama-cpp-python's LlamaState: the evaluated tokens, the last logits, the cache bytes."""

    input_ids: np.ndarray
    scores: np.ndarray
    n_tokens: int
    llama_state: bytes
    llama_state_size: int
    seed: int


def save(llm: Llama) -> LlamaState:
    n = llm.n_tokens
    tokens = llm.input_ids[:n].tolist()
    data = state_file.to_bytes(seq_state.capture(llm.ctx, 0, tokens))
    last = llm._last_logits.numpy().copy() if llm._last_logits.numel() else np.zeros(0, dtype=np.single)
    return LlamaState(np.array(tokens, dtype=np.intc), last, n, data, len(data), llm.seed)


def load(llm: Llama, st: LlamaState) -> None:
    """Restore; a state from another model or cache type is refused before anything changes."""
    parsed = state_file.from_bytes(bytes(st.llama_state), "state")
    n = seq_state.restore(llm.ctx, parsed, 0)
    llm.input_ids[:n] = parsed.tokens
    llm.n_tokens = n
    if st.scores.size == llm.n_vocab():
        llm._last_logits = torch.from_numpy(np.asarray(st.scores, dtype=np.single).copy())
        llm.scores[0] = llm._last_logits.numpy()
    llm.seed = st.seed


def save_file(llm: Llama, path: str | os.PathLike[str]) -> int:
    """The state as a safetensors file (no logits: the next completion re-evaluates one token)."""
    tokens = llm.input_ids[: llm.n_tokens].tolist()
    return state_file.write_file(path, seq_state.capture(llm.ctx, 0, tokens))


def load_file(llm: Llama, path: str | os.PathLike[str]) -> int:
    parsed, _ = state_file.read_file(path)
    n = seq_state.restore(llm.ctx, parsed, 0)
    llm.input_ids[:n] = parsed.tokens
    llm.n_tokens = n
    llm._last_logits = torch.empty(0)
    return n
