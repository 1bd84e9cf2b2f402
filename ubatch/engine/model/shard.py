"""One tensor-parallel rank's part of a model, cut Megatron-style from the stored blocks.

Q, K, V, gate and up are split by output rows and attention output and FFN down by their input
columns, so each rank computes whole heads and a slice of the FFN and one all-reduce per product
pair makes the residual whole again; the token embedding and the output head are split over the
vocabulary. Row cuts are views of the memory-mapped file (a rank touches only its rows' pages);
column cuts copy each row's blocks of the rank's range. Nothing is requantised: a cut that does
not fall on a block boundary is refused, naming the tensor.

When there are fewer KV heads than ranks, each KV head is held by the ranks whose query heads
read it (as vLLM replicates them), so a rank's KV cache then holds one head, not a fraction.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.model.archs.base import Cut
from ubatch.kernels.ops import Collective
from ubatch.kernels.quant.weight import QWeight


class Channel(Protocol):
    """Where rank 0 announces what its contexts do, so that every other rank does the same
    (engine/parallel implements it). Messages are the dataclasses of engine/context/messages.py."""

    def turn(self) -> AbstractContextManager[None]:
        """Held while a message and the collectives it starts run: one context's step at a time."""

    def send(self, msg: object) -> None: ...

    def release(self, key: int) -> None:
        """A context that rank 0 dropped: the others drop theirs with the next message (a
        finalizer may run in the middle of a step, when nothing can be sent)."""


class NoCollective:
    """The collective of a shard made for planning only (`info -tp`, `explain -tp`): shapes and
    sizes are real, running a graph is not."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def all_reduce(self, x: torch.Tensor) -> None:
        raise RuntimeError("a planning shard cannot run: start the ranks (-tp N) to decode")

    def gather_cols(self, x: torch.Tensor, out: torch.Tensor) -> None:
        raise RuntimeError("a planning shard cannot run: start the ranks (-tp N) to decode")


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of the model this process holds and how it talks to the others."""

    rank: int
    world: int
    comm: Collective
    vocab_rows: int  # the vocabulary rows each rank holds: n_vocab / world, rounded up
    channel: Channel | None = None  # rank 0 of a running group: announces its contexts' work
    local_ranks: int = 0  # ranks sharing this machine's cores (0: all `world`)
    key: int = 0  # the model's key in rank 0's messages (engine/context/messages.py)

    @property
    def threads_share(self) -> int:
        """How many ranks divide this machine's cores when -t is left to the default."""
        return self.local_ranks or self.world

    @staticmethod
    def rows_of(n_vocab: int, world: int) -> int:
        """The vocabulary rows each rank holds: equal slices (the last padded with zero rows)."""
        return -(-n_vocab // world)

    @classmethod
    def for_plan(cls, world: int, n_vocab: int) -> Shard:
        """Rank 0's part for sizing only (`info -tp N`): no rank is started, nothing can run."""
        return cls(0, world, NoCollective(0, world), cls.rows_of(n_vocab, world))

    @property
    def vocab_lo(self) -> int:
        return self.rank * self.vocab_rows

    def local_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """Token ids as rows of this rank's embedding slice; ids another rank holds point at the
        slice's zero row (index vocab_rows), so the all-reduce after the lookup adds nothing."""
        local = tokens.astype(np.int64) - self.vocab_lo
        return np.where((local >= 0) & (local < self.vocab_rows), local, self.vocab_rows)


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Rank r's query heads [q0, q0 + n_q) and KV heads [kv0, kv0 + n_kv)."""

    q0: int
    n_q: int
    kv0: int
    n_kv: int


def head_split(n_head: int, n_head_kv: int, rank: int, world: int) -> HeadSplit:
    n_q = n_head // world
    q0 = rank * n_q
    group = n_head // n_head_kv  # query heads per KV head
    n_kv = max(1, n_head_kv // world)
    return HeadSplit(q0, n_q, q0 // group, n_kv)


def check_split(n_head: int, n_head_kv: int, n_ff: int, world: int, src: str) -> None:
    """The head and FFN counts a world size must divide, each refusal naming the count."""
    if world < 1:
        raise ModelLoadError(f"--tensor-parallel {world}: the number of ranks must be at least 1")
    if n_head % world:
        raise ModelLoadError(
            f"{src}: {n_head} attention heads do not split over {world} ranks; use a -tp that divides {n_head}"
        )
    if n_head_kv % world and world % n_head_kv:
        raise ModelLoadError(
            f"{src}: {n_head_kv} KV heads neither split over nor replicate evenly across {world} ranks; "
            f"use a -tp that divides or is a multiple of {n_head_kv}"
        )
    if n_ff % world:
        raise ModelLoadError(
            f"{src}: feed_forward_length {n_ff} does not split over {world} ranks; use a -tp that divides {n_ff}"
        )


def row_slice(w: QWeight, r0: int, r1: int) -> QWeight:
    """Rows [r0, r1) of a stored matrix: a view of its bytes (whole rows are whole blocks)."""
    rb = w.row_bytes
    return QWeight(w.name, w.raw[r0 * rb : r1 * rb], w.ggml_type, (r1 - r0, *w.shape[1:]))


def col_slice(w: QWeight, c0: int, c1: int) -> QWeight:
    """Columns [c0, c1) of a stored matrix: each row's blocks of that range, copied. Refused when
    the range does not start and end on the type's block boundary."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(w.ggml_type)]
    if c0 % block or c1 % block:
        t = GGMLQuantizationType(w.ggml_type).name
        raise ModelLoadError(
            f"tensor {w.name!r} ({t}, blocks of {block}) cannot be split at column {c0 if c0 % block else c1} "
            f"for tensor parallelism: its ranks' column ranges must fall on block boundaries; use a smaller -tp"
        )
    rows = w.raw.view(w.shape[0], w.row_bytes)
    part = rows[:, c0 // block * size : c1 // block * size].contiguous().view(-1)
    return QWeight(w.name, part, w.ggml_type, (w.shape[0], c1 - c0))


def vocab_slice(w: QWeight, lo: int, n_rows: int, zero_rows: int) -> QWeight:
    """n_rows rows of a [n_vocab, n_embd] matrix from lo, padded with all-zero rows (which every
    ggml type decodes to 0.0) to n_rows + zero_rows: a view when no padding is needed."""
    hi = min(lo + n_rows, w.shape[0])
    have = max(0, hi - lo)
    if have == n_rows and zero_rows == 0:
        return row_slice(w, lo, hi)
    rb = w.row_bytes
    raw = torch.zeros((n_rows + zero_rows) * rb, dtype=torch.uint8, device=w.raw.device)
    if have:
        raw[: have * rb].copy_(w.raw[lo * rb : hi * rb])
    return QWeight(w.name, raw, w.ggml_type, (n_rows + zero_rows, *w.shape[1:]))


@dataclass(frozen=True, slots=True)
class Cutter:
    """Rank `rank`'s part of a layer's tensors, by each one's declared cut (archs/base.py `Cut`):
    output rows of its query heads, KV heads or FFN slice; the matching input columns; or whole."""

    split: HeadSplit
    dk: int
    dv: int
    n_ff: int
    rank: int
    world: int
    n_ff_exp: int = 0  # one expert's FFN width (mixtures of experts)
    n_ff_shexp: int = 0  # the shared experts' FFN width

    def rows(self, cut: Cut) -> tuple[int, int]:
        """The range of output rows (or input columns) a cut keeps."""
        s, f = self.split, self.n_ff // self.world
        match cut:
            case "q_rows":
                return s.q0 * self.dk, (s.q0 + s.n_q) * self.dk
            case "k_rows":
                return s.kv0 * self.dk, (s.kv0 + s.n_kv) * self.dk
            case "v_rows":
                return s.kv0 * self.dv, (s.kv0 + s.n_kv) * self.dv
            case "q_cols":
                return s.q0 * self.dv, (s.q0 + s.n_q) * self.dv
            case "ff_rows" | "ff_cols":
                return self.rank * f, (self.rank + 1) * f
            case "exp_rows" | "exp_cols":
                fe = self.n_ff_exp // self.world
                return self.rank * fe, (self.rank + 1) * fe
            case "sh_rows" | "sh_cols":
                fs = self.n_ff_shexp // self.world
                return self.rank * fs, (self.rank + 1) * fs
        raise ValueError(f"no row range for cut {cut!r}")

    def matrix(self, cut: Cut, w: QWeight) -> QWeight:
        if cut in ("q_rows", "k_rows", "v_rows", "ff_rows", "sh_rows"):
            return row_slice(w, *self.rows(cut))
        if cut in ("q_cols", "ff_cols", "sh_cols"):
            return col_slice(w, *self.rows(cut))
        if cut == "replicated":
            return w
        if cut == "head_exps":  # this rank's heads of a per-head stack: a view
            s, per = self.split, w.nbytes // w.shape[0]
            return QWeight(w.name, w.raw[s.q0 * per : (s.q0 + s.n_q) * per], w.ggml_type, (s.n_q, *w.shape[1:]))
        if cut in ("exp_rows", "exp_cols", "exp_gate_up"):  # each expert's as a dense FFN's, copied into one tensor
            if cut == "exp_gate_up":  # this rank's gate rows then its up rows, of each expert
                (lo, hi), f = self.rows("exp_rows"), w.shape[1] // 2
                halves = [
                    (row_slice(w.expert(e), lo, hi), row_slice(w.expert(e), f + lo, f + hi)) for e in range(w.shape[0])
                ]
                raw = torch.cat([h.raw for pair in halves for h in pair])
                return QWeight(w.name, raw, w.ggml_type, (w.shape[0], 2 * (hi - lo), w.shape[2]))
            cut_one = row_slice if cut == "exp_rows" else col_slice
            parts = [cut_one(w.expert(e), *self.rows(cut)) for e in range(w.shape[0])]
            raw = torch.cat([p.raw for p in parts])
            return QWeight(w.name, raw, w.ggml_type, (w.shape[0], *parts[0].shape))
        raise ValueError(f"layer tensor {w.name!r} cannot be cut as {cut!r}")

    def vector(self, cut: Cut, v: torch.Tensor) -> torch.Tensor:
        """A norm weight (whole) or a bias of row-cut outputs (its rows)."""
        if cut == "none":
            raise ModelLoadError(
                "this architecture normalises Q and K over every head at once, which ranks that each "
                "hold some heads cannot compute; run it without -tp"
            )
        if cut == "replicated":
            return v
        if cut == "summed":  # a bias after the reduction's sum: added by one rank only
            return v if self.rank == 0 else torch.zeros_like(v)
        if cut == "heads":  # one value per query head: this rank's heads
            return v[self.split.q0 : self.split.q0 + self.split.n_q]
        lo, hi = self.rows(cut)
        if cut == "exp_rows":  # each expert's bias of its row-cut outputs
            return v[:, lo:hi].contiguous()
        return v[lo:hi]
