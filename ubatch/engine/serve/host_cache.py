"""llama-server's host-memory prompt cache (`--cache-ram N`): prefixes that leave the KV cache
kept in RAM as saved sequence states (engine/context/state.py), least recently used out first,
found by longest common prefix through a radix tree of their tokens (engine/serve/radix_tree.py).

A prompt whose longest cached prefix is here is restored (its K/V rows written back into cells)
instead of prefilled. States are held as captured, cut to the tokens whose K/V a fresh prefill
would give, so a restore never changes an answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ubatch.engine.context.state_file import SeqState
from ubatch.engine.serve.radix_tree import RadixTree

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
    key: int = 0  # the entry's holder key in the cache's radix tree
    t_used: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class HostCache:
    """Saved prefixes up to `limit_mib` MiB (-1: no limit, 0: off). `entries` is in order of
    use (least recent first); `index` holds every entry's tokens, so a lookup costs the prompt's
    length, not the number of entries."""

    limit_mib: int = DEFAULT_CACHE_RAM_MIB
    entries: dict[int, HostEntry] = field(default_factory=dict, init=False)
    index: RadixTree[int] = field(default_factory=RadixTree, init=False, repr=False)
    n_saved: int = 0  # states put here over the server's life
    n_evicted: int = 0  # states dropped to stay under the limit
    nbytes: int = field(default=0, init=False)  # of every entry's state
    n_tokens: int = field(default=0, init=False)  # of every entry
    next_key: int = field(default=0, init=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.limit_mib != 0

    def holds(self, tokens: list[int]) -> bool:
        """Whether an entry already starts with all of `tokens` (saving them again adds nothing)."""
        return self.index.longest(tokens)[1] == len(tokens)

    def put(self, state: SeqState) -> bool:
        """Keep `state`; entries it extends go, then the least recently used until it fits."""
        if not self.enabled or not state.tokens or self.holds(state.tokens):
            return False
        nbytes = state_bytes(state)
        limit = self.limit_mib * 1024 * 1024
        if 0 < limit < nbytes:
            return False
        toks = list(state.tokens)
        for key in self.index.within(toks):
            self._drop(key)
        while limit > 0 and self.entries and self.nbytes + nbytes > limit:
            self._drop(next(iter(self.entries)))
            self.n_evicted += 1
        key, self.next_key = self.next_key, self.next_key + 1
        self.entries[key] = HostEntry(toks, state, nbytes, key)
        self.index.insert(key, toks)
        self.nbytes += nbytes
        self.n_tokens += len(toks)
        self.n_saved += 1
        return True

    def best(self, prompt: list[int]) -> tuple[HostEntry | None, int]:
        """An entry sharing the longest prefix with `prompt`, and its length."""
        key, n = self.index.longest(prompt)
        return (None, 0) if key is None else (self.entries[key], n)

    def touch(self, e: HostEntry) -> None:
        """`e` was used: it becomes the last to be evicted (if a later put has not dropped it)."""
        e.t_used = time.perf_counter()
        if self.entries.get(e.key) is e:
            self.entries[e.key] = self.entries.pop(e.key)

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.nbytes = self.n_tokens = 0

    def _drop(self, key: int) -> None:
        e = self.entries.pop(key)
        self.index.remove(key)
        self.nbytes -= e.nbytes
        self.n_tokens -= len(e.tokens)
