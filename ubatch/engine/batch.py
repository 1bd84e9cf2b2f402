"""Batches of token slots and their split into ubatches (one trip through the network each).

A batch is what a caller submits to `Context.decode`: per slot a token, its position, the set
of sequences it belongs to and whether its logits are wanted. The context cuts it into ubatches
of at most n_ubatch slots: `split_simple` (slots in order) for a single-stream cache,
`split_equal` (the same number of slots from each of several sequences, grouped by sequence)
when every sequence has its own stream of cells.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np


class RowKind(StrEnum):
    """What a batch row is; its value is the letter `explain` draws for it."""

    PROMPT = "p"
    GENERATED = "g"
    DRAFTED = "d"  # a speculative draft's token: its cell may be removed again after verification


@dataclass(slots=True)
class Batch:
    token: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seq_id: list[list[int]] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)
    # what each row is (empty: not said, a prompt). `explain` draws it; the placement reads it
    # once: drafted rows may be removed again, so a batch with them keeps the window cells its
    # first row still sees (engine/kv/memory.py init_batch)
    kind: list[RowKind] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.token)

    def add(
        self, token: int, pos: int, seq_ids: list[int] | int, logits: bool = False, kind: RowKind = RowKind.PROMPT
    ) -> None:
        self.token.append(int(token))
        self.pos.append(int(pos))
        self.seq_id.append([seq_ids] if isinstance(seq_ids, int) else list(seq_ids))
        self.logits.append(bool(logits))
        self.kind.append(kind)

    def kind_of(self, i: int) -> RowKind:
        return self.kind[i] if i < len(self.kind) else RowKind.PROMPT

    @classmethod
    def from_tokens(
        cls, tokens: list[int], pos0: int, seq_id: int = 0, all_logits: bool = False, kind: RowKind = RowKind.PROMPT
    ) -> Batch:
        """Consecutive tokens of one sequence; only the last one is an output unless all_logits."""
        n = len(tokens)
        return cls(
            list(map(int, tokens)),
            list(range(pos0, pos0 + n)),
            [[seq_id] for _ in range(n)],
            [all_logits or i == n - 1 for i in range(n)],
            [kind] * n,
        )


@dataclass(slots=True)
class UBatch:
    """A slice of a batch that runs as one forward pass; arrays are per token slot."""

    token: np.ndarray  # int64 [n_tokens]
    pos: np.ndarray  # int64 [n_tokens]
    seq_id: list[list[int]]  # all sequence ids of each slot
    seq_id0: np.ndarray  # int64 [n_tokens]: the first sequence id (the one the mask uses)
    output: np.ndarray  # bool [n_tokens]
    batch_idx: np.ndarray  # int64 [n_tokens]: index of each slot in the source batch
    n_seqs: int = 1  # split_equal: number of sequence groups, each n_tokens // n_seqs slots

    @property
    def n_tokens(self) -> int:
        return int(self.token.shape[0])


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (prompt-cache reuse)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def make_ubatch(batch: Batch, idx: np.ndarray, n_seqs: int = 1) -> UBatch:
    return UBatch(
        token=np.asarray(batch.token, dtype=np.int64)[idx],
        pos=np.asarray(batch.pos, dtype=np.int64)[idx],
        seq_id=[batch.seq_id[i] for i in idx],
        seq_id0=np.asarray([batch.seq_id[i][0] for i in idx], dtype=np.int64),
        output=np.asarray(batch.logits, dtype=bool)[idx],
        batch_idx=idx,
        n_seqs=n_seqs,
    )


def split_simple(batch: Batch, n_ubatch: int) -> list[UBatch]:
    """Slots in batch order, n_ubatch at a time; sequence ids play no part."""
    idx = np.arange(batch.n_tokens, dtype=np.int64)
    if batch.n_tokens <= n_ubatch:  # one ubatch, the batch as it is (every decode step): no gathers
        seq0 = [s[0] for s in batch.seq_id]
        return [
            UBatch(
                np.array(batch.token, np.int64),
                np.array(batch.pos, np.int64),
                list(batch.seq_id),
                np.array(seq0, np.int64),
                np.array(batch.logits, bool),
                idx,
            )
        ]
    return [make_ubatch(batch, idx[i : i + n_ubatch]) for i in range(0, batch.n_tokens, n_ubatch)]


class SplitError(Exception):
    """The batch cannot be split as the memory requires (llama.cpp: decode returns 1)."""


def split_equal(batch: Batch, n_ubatch: int, sequential: bool) -> list[UBatch]:
    """llama.cpp's split_equal: per ubatch, a set of distinct sequences (consecutive ids when
    `sequential`, i.e. adjacent KV streams) contributing the same number of slots each."""
    used = np.zeros(batch.n_tokens, dtype=bool)
    per_seq: dict[tuple[int, ...], list[int]] = {}
    for i, sids in enumerate(batch.seq_id):
        per_seq.setdefault(tuple(sorted(sids)), []).append(i)
    if sequential and any(len(k) > 1 for k in per_seq):
        raise SplitError(
            "sequential split is not supported when there are coupled sequences in the input batch (you may need to use the -kvu flag)"
        )
    cursor = {k: 0 for k in per_seq}
    out: list[UBatch] = []
    while not used.all():
        first = int(np.flatnonzero(~used)[0])
        sets = [tuple(sorted(batch.seq_id[first]))]
        seen = set(sets[0])
        for i in np.flatnonzero(~used).tolist():
            key = tuple(sorted(batch.seq_id[i]))
            if key in sets or seen & set(key) or len(sets) >= n_ubatch:
                continue
            if sequential and key[0] != sets[-1][0] + 1:
                continue
            sets.append(key)
            seen |= set(key)
        rounds = 0
        while all(cursor[k] + rounds < len(per_seq[k]) for k in sets) and (rounds + 1) * len(sets) <= n_ubatch:
            rounds += 1
        idx = np.concatenate([per_seq[k][cursor[k] : cursor[k] + rounds] for k in sets]).astype(np.int64)
        for k in sets:
            cursor[k] += rounds
        used[idx] = True
        out.append(make_ubatch(batch, idx, n_seqs=len(sets)))
    return out
