"""llama-server's host-memory prompt cache (`--cache-ram N`): prefixes that leave the KV cache
kept in RAM as saved sequence states (engine/context/state.py), least recently used out first.

A prompt whose longest cached prefix is here is restored (its K/V rows written back into cells)
instead of prefilled. States are held as captured, cut to the tokens whose K/V a fresh prefill
would give, so a restore never changes an answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ubatch.engine.batch import common_prefix
from ubatch.engine.context.state_file import SeqState

DEFAULT_CACHE_RAM_MIB = 8192  # llama.cpp's common_params.cache_ram_mib


def cut_state(state: SeqState, n: int) -> SeqState:
    """The state of the first n tokens: cells at positions >= n dropped from every cache."""
    if n >= state.n_tokens:
        return state
    tensors: dict[str, torch.Tensor] = {}
    caches = sorted({k.split(".")[0] for k in state.tensors})
    for ci in caches:
        keep = state.tensors[f"{ci}.pos"] < n
        for k, t in state.tensors.items():
            if k.split(".")[0] == ci:
                tensors[k] = t[keep].clone()
    return SeqState(dict(state.header), list(state.tokens[:n]), tensors)


def state_bytes(state: SeqState) -> int:
    return sum(t.numel() * t.element_size() for t in state.tensors.values())


@dataclass(slots=True)
class HostEntry:
    tokens: list[int]
    state: SeqState
    nbytes: int
    t_used: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class HostCache:
    """Saved prefixes up to `limit_mib` MiB (-1: no limit, 0: off)."""

    limit_mib: int = DEFAULT_CACHE_RAM_MIB
    entries: list[HostEntry] = field(default_factory=list)
    n_saved: int = 0  # states put here over the server's life
    n_evicted: int = 0  # states dropped to stay under the limit

    @property
    def enabled(self) -> bool:
        return self.limit_mib != 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def n_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    def holds(self, tokens: list[int]) -> bool:
        """Whether an entry already starts with all of `tokens` (saving them again adds nothing)."""
        n = len(tokens)
        return any(len(e.tokens) >= n and e.tokens[:n] == tokens for e in self.entries)

    def put(self, state: SeqState) -> bool:
        """Keep `state`; entries it extends go, then the least recently used until it fits."""
        if not self.enabled or not state.tokens or self.holds(state.tokens):
            return False
        nbytes = state_bytes(state)
        limit = self.limit_mib * 1024 * 1024
        if 0 < limit < nbytes:
            return False
        toks = state.tokens
        self.entries = [
            e for e in self.entries if not (len(e.tokens) <= len(toks) and toks[: len(e.tokens)] == e.tokens)
        ]
        if limit > 0:
            self.entries.sort(key=lambda e: e.t_used)
            while self.entries and self.nbytes + nbytes > limit:
                self.entries.pop(0)
                self.n_evicted += 1
        self.entries.append(HostEntry(list(toks), state, nbytes))
        self.n_saved += 1
        return True

    def best(self, prompt: list[int]) -> tuple[HostEntry | None, int]:
        """The entry sharing the longest prefix with `prompt`, and its length."""
        best, n_best = None, 0
        for e in self.entries:
            if e.tokens and prompt and e.tokens[0] == prompt[0]:
                n = common_prefix(e.tokens, prompt)
                if n > n_best:
                    best, n_best = e, n
        return best, n_best

    def touch(self, e: HostEntry) -> None:
        e.t_used = time.perf_counter()

    def clear(self) -> None:
        self.entries.clear()
