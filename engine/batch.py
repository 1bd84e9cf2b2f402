"""Batches of token slots and their split into ubatches (one trip through the network each).

A batch is what a caller submits to `Context.decode`: per slot a token, its position, the set
of sequences it belongs to and whether its logits are wanted. The context cuts it into ubatches
of at most n_ubatch slots (llama.cpp's split_simple for a single-stream cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Batch:
    token: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seq_id: list[list[int]] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.token)

    def add(self, token: int, pos: int, seq_ids: list[int] | int, logits: bool = False) -> None:
        self.token.append(int(token))
        self.pos.append(int(pos))
        self.seq_id.append([seq_ids] if isinstance(seq_ids, int) else list(seq_ids))
        self.logits.append(bool(logits))

    @classmethod
    def from_tokens(cls, tokens: list[int], pos0: int, seq_id: int = 0,
                    all_logits: bool = False) -> Batch:
        """Consecutive tokens of one sequence; only the last one is an output unless all_logits."""
        n = len(tokens)
        return cls(list(map(int, tokens)), list(range(pos0, pos0 + n)), [[seq_id] for _ in range(n)],
                   [all_logits or i == n - 1 for i in range(n)])


@dataclass(slots=True)
class UBatch:
    """A slice of a batch that runs as one forward pass; arrays are per token slot."""

    token: np.ndarray  # int64 [n_tokens]
    pos: np.ndarray  # int64 [n_tokens]
    seq_id: list[list[int]]  # all sequence ids of each slot
    seq_id0: np.ndarray  # int64 [n_tokens]: the first sequence id (the one the mask uses)
    output: np.ndarray  # bool [n_tokens]
    batch_idx: np.ndarray  # int64 [n_tokens]: index of each slot in the source batch

    @property
    def n_tokens(self) -> int:
        return int(self.token.shape[0])

    @property
    def n_outputs(self) -> int:
        return int(self.output.sum())


def make_ubatch(batch: Batch, idx: np.ndarray) -> UBatch:
    return UBatch(
        token=np.asarray(batch.token, dtype=np.int64)[idx],
        pos=np.asarray(batch.pos, dtype=np.int64)[idx],
        seq_id=[batch.seq_id[i] for i in idx],
        seq_id0=np.asarray([batch.seq_id[i][0] for i in idx], dtype=np.int64),
        output=np.asarray(batch.logits, dtype=bool)[idx],
        batch_idx=idx,
    )


def split_simple(batch: Batch, n_ubatch: int) -> list[UBatch]:
    """Slots in batch order, n_ubatch at a time; sequence ids play no part."""
    idx = np.arange(batch.n_tokens, dtype=np.int64)
    return [make_ubatch(batch, idx[i : i + n_ubatch]) for i in range(0, batch.n_tokens, n_ubatch)]
