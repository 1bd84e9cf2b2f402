"""What the scheduler remembers about its work: a record per decode call and per released slot,
and llama-server's metrics counters. Kept apart from the loop so /metrics, /iterations and the
tests read plain data, never the scheduler's internals."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class IterationRecord:
    """What one decode call carried: rows per sequence id, generation vs prompt rows."""

    index: int
    n_tokens: int
    n_outputs: int
    rows: dict[int, int]  # seq id -> rows in this decode
    n_gen: int
    n_prompt: int
    n_ubatch: int
    ms: float
    retries: int = 0
    n_queued: int = 0  # tasks waiting for a slot when this batch was assembled


@dataclass(slots=True)
class PrefixReuse:
    """Where a request's cached prompt tokens came from (they add up to its n_prompt_cache):
    its slot's own cells, cells of another sequence (shared in a unified cache, copied between
    streams otherwise) or a state restored from host memory (--cache-ram)."""

    n_own: int = 0
    n_shared: int = 0
    n_ram: int = 0
    source: int = -1  # the sequence id the shared tokens came from (-1: none)

    @property
    def total(self) -> int:
        return self.n_own + self.n_shared + self.n_ram


@dataclass(slots=True)
class ReleaseRecord:
    slot: int
    task: int
    reason: str  # "eos" | "word" | "limit" | "cancelled" | "error" | "shutdown"
    iteration: int
    cancel_iteration: int = -1
    reuse: PrefixReuse = field(default_factory=PrefixReuse)  # the task's cached prompt, by source


@dataclass(slots=True)
class TokenTotals:
    """Prompt and generated tokens and the milliseconds they took, over the server's life
    (/metrics' gauges are the difference between two reads)."""

    n_prompt_tokens: int = 0
    t_prompt_ms: float = 0.0
    n_predicted: int = 0
    t_predicted_ms: float = 0.0

    def add_prompt(self, n_tokens: int, ms: float) -> None:
        self.n_prompt_tokens += n_tokens
        self.t_prompt_ms += ms

    def add_generation(self, n_tokens: int, ms: float) -> None:
        self.n_predicted += n_tokens
        self.t_predicted_ms += ms


@dataclass(slots=True)
class SchedulerStats:
    """llama-server's server_metrics plus the batching counters this project is about."""

    t_start: float = field(default_factory=time.time)
    total: TokenTotals = field(default_factory=TokenTotals)
    n_prompt_cached_total: int = 0  # prompt tokens found in a slot's cache
    n_reused_own_total: int = 0  # ... of which the slot's own cells held
    n_reused_shared_total: int = 0  # ... another sequence's cells held (shared or copied)
    n_reused_ram_total: int = 0  # ... restored from host memory (--cache-ram)
    n_hits_own: int = 0  # requests that kept some of their slot's cells
    n_hits_shared: int = 0  # requests that took a prefix from another sequence
    n_hits_ram: int = 0  # requests that restored a prefix from host memory
    n_waited_prefix: int = 0  # launches held back for a prefix another slot was computing
    n_evictions: int = 0  # idle sequences' cells given up under KV pressure
    n_tokens_max: int = 0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    n_rows_total: int = 0
    n_ubatch_total: int = 0
    decodes_by_n_seqs: Counter[int] = field(default_factory=Counter)
    n_requests: int = 0
    n_cancelled: int = 0

    def prompt_reused(self, r: PrefixReuse) -> None:
        """A task took its slot with `r` of its prompt already in cells."""
        self.n_prompt_cached_total += r.total
        self.n_reused_own_total += r.n_own
        self.n_reused_shared_total += r.n_shared
        self.n_reused_ram_total += r.n_ram
        self.n_hits_own += r.n_own > 0
        self.n_hits_shared += r.n_shared > 0
        self.n_hits_ram += r.n_ram > 0

    def prompt_done(self, n_tokens: int, ms: float) -> None:
        self.total.add_prompt(n_tokens, ms)

    def generation_done(self, n_tokens: int, ms: float) -> None:
        self.total.add_generation(n_tokens, ms)

    def count_decode(self, rec: IterationRecord, n_busy: int) -> None:
        """One decode call: the batching counters behind /metrics' rows-per-decode figures."""
        self.n_decode_total += 1
        self.n_busy_slots_total += n_busy
        self.n_rows_total += rec.n_tokens
        self.n_ubatch_total += rec.n_ubatch
        self.decodes_by_n_seqs[len(rec.rows)] += 1
