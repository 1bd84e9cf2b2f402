"""Speculative decoding: drafts proposed for a sequence, verified by the target in one decode.

A drafter guesses the next few tokens cheaply: `ngram-simple` looks the last tokens up in the
sequence's own history (prompt lookup, no second model); `draft-simple` runs a small draft model
with its own context and KV cache (both in engine/spec/draft.py, which builds a `Speculator`).
The generation step (engine/completion/complete.py for one sequence, engine/serve/slot_spec.py
for the server's slots) adds the sampled token and the drafted ones to the same batch, one row
each with an output, and engine/spec/verify.py accepts the longest prefix the target agrees
with. Drafters are tried in llama.cpp's order, n-gram ones before the draft model; the first
that proposes something wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ubatch.engine.errors import UbatchError

# llama.cpp's --spec-type names (common_speculative_all_types_str), and those ubatch builds
SPEC_TYPES_LLAMA = (
    "none",
    "draft-simple",
    "draft-eagle3",
    "draft-mtp",
    "draft-dflash",
    "draft-dspark",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
)
SPEC_TYPES = ("none", "draft-simple", "ngram-simple")


class SpecError(UbatchError):
    """A speculative-decoding setting that cannot work (one line for the user)."""


@dataclass(slots=True)
class SpecParams:
    """common_params_speculative's fields that ubatch implements, with llama.cpp's defaults."""

    types: tuple[str, ...] = ()  # --spec-type, in the order given; () or ("none",): off
    n_max: int = 3  # --spec-draft-n-max: tokens drafted per step at most
    n_min: int = 0  # --spec-draft-n-min: shorter drafts are dropped
    p_min: float = 0.0  # --spec-draft-p-min: the draft model stops below this top-1 probability
    probabilistic: bool = False  # --spec-draft-sampling probabilistic: rejection sampling
    ngram_size_n: int = 12  # --spec-ngram-simple-size-n: tokens looked up
    ngram_size_m: int = 48  # --spec-ngram-simple-size-m: tokens copied after a match
    ngram_min_hits: int = 1  # --spec-ngram-simple-min-hits (ngram-simple proposes on 1 hit)

    @property
    def enabled(self) -> bool:
        return self.n_max > 0 and any(t != "none" for t in self.types)

    def check(self) -> None:
        for t in self.types:
            if t not in SPEC_TYPES_LLAMA:
                raise SpecError(f"unknown --spec-type {t!r}; use a comma-separated list of {', '.join(SPEC_TYPES)}")
            if t not in SPEC_TYPES:
                raise SpecError(
                    f"--spec-type {t} is not supported by ubatch; use {', '.join(SPEC_TYPES[1:])} (or none)"
                )
        if self.n_max < 0:
            raise SpecError(f"--spec-draft-n-max must be >= 0, not {self.n_max}")
        cap = self.draft_max() if self.enabled else self.n_max
        if self.n_min < 0 or self.n_min > max(cap, 0):
            raise SpecError(f"--spec-draft-n-min must be between 0 and the longest draft ({cap}), not {self.n_min}")
        if not 0.0 <= self.p_min <= 1.0:
            raise SpecError(f"--spec-draft-p-min must be between 0 and 1, not {self.p_min}")
        if not 1 <= self.ngram_size_n <= 1024 or not 1 <= self.ngram_size_m <= 1024:
            raise SpecError("--spec-ngram-simple-size-n and -size-m must be between 1 and 1024")

    def draft_max(self) -> int:
        """The longest draft the requested drafters may propose (0 when off): --spec-draft-n-max for
        the draft model, --spec-ngram-simple-size-m for n-grams, as llama.cpp caps each."""
        if not self.enabled:
            return 0
        return max((self.n_max if t == "draft-simple" else self.ngram_size_m for t in self.ordered()), default=0)

    def n_outputs_max(self, n_outputs_max: int, n_parallel: int) -> int:
        """llama-server's n_outputs_max with speculation: room for every slot's row and draft,
        n_parallel x (1 + draft); a larger request (or 0, which means n_batch) stands."""
        if not self.enabled or n_outputs_max == 0:
            return n_outputs_max
        return max(n_outputs_max, n_parallel * (1 + self.draft_max()))

    def ordered(self) -> list[str]:
        """The drafters to try, n-gram ones first (llama.cpp's priority), each once."""
        seen = [t for i, t in enumerate(self.types) if t != "none" and t not in self.types[:i]]
        return sorted(seen, key=lambda t: not t.startswith("ngram"))


@dataclass(slots=True)
class SpecStats:
    """What speculation did: llama.cpp's draft_n / draft_n_accepted, and acceptance per position."""

    n_drafts: int = 0  # verifications run (a draft was proposed)
    n_drafted: int = 0  # tokens proposed
    n_accepted: int = 0  # proposed tokens the target agreed with
    n_verify_ubatches: int = 0  # forward passes the verifications took
    t_verify_ms: float = 0.0  # time in the verifications' decodes (one sequence's; 0 in the server)
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted
    drafted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts that had a token i

    def add(self, n_drafted: int, n_accepted: int, n_ubatches: int = 0, ms: float = 0.0) -> None:
        self.n_drafts += 1
        self.t_verify_ms += ms
        self.n_drafted += n_drafted
        self.n_accepted += n_accepted
        self.n_verify_ubatches += n_ubatches
        grow = n_drafted - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for i in range(n_drafted):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += i < n_accepted

    def merge(self, other: SpecStats) -> None:
        self.n_drafts += other.n_drafts
        self.n_drafted += other.n_drafted
        self.n_accepted += other.n_accepted
        self.n_verify_ubatches += other.n_verify_ubatches
        self.t_verify_ms += other.t_verify_ms
        n = max(len(self.drafted_per_pos), len(other.drafted_per_pos))

        def add(a: list[int], b: list[int]) -> list[int]:
            return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]

        self.drafted_per_pos = add(self.drafted_per_pos, other.drafted_per_pos)
        self.accepted_per_pos = add(self.accepted_per_pos, other.accepted_per_pos)

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_len(self) -> float:
        """Tokens per verification, the target's own included (llama.cpp's "mean len")."""
        return (self.n_accepted + self.n_drafts) / self.n_drafts if self.n_drafts else 0.0

    def per_position(self) -> list[float]:
        """Acceptance at each draft position over all verifications (llama.cpp's "acc per pos")."""
        return [a / self.n_drafts if self.n_drafts else 0.0 for a in self.accepted_per_pos]


@dataclass(slots=True)
class Draft:
    """A proposal for one sequence: the tokens, who proposed them, and (probabilistic drafting)
    the draft's probability of each token, for the rejection rule."""

    tokens: list[int]
    source: str = ""
    q: list[dict[int, float]] = field(default_factory=list)


class Drafter(Protocol):
    name: str
    n_max: int  # its own cap: --spec-draft-n-max for the draft model, -size-m for n-grams

    def draft(self, seq_id: int, tokens: list[int], sampled: int, n_max: int) -> Draft: ...
    def forget(self, seq_id: int) -> None: ...


def n_draft_max(n_ctx: int, n_cached: int, n_predict: int, n_decoded: int, n_max: int) -> int:
    """llama-server's bound on a draft: room in the slot's context (two cells spare) and, with
    n_predict, one fewer than the tokens still to generate (the target adds its own)."""
    n = min(n_max, n_ctx - n_cached - 2)
    if n_predict >= 0:
        n = min(n, n_predict - n_decoded - 1)
    return max(0, n)


class Speculator:
    """The drafters of one context (shared by its sequences) and the statistics of their drafts."""

    def __init__(self, params: SpecParams, drafters: list[Drafter]) -> None:
        self.params, self.drafters = params, drafters
        self.stats = SpecStats()

    @property
    def n_max(self) -> int:
        """The longest draft any drafter proposes (what n_outputs_max must make room for)."""
        return max((d.n_max for d in self.drafters), default=0)

    def draft(self, seq_id: int, tokens: list[int], sampled: int, n_max: int) -> Draft:
        """The first drafter's non-empty proposal (at most n_max tokens and the drafter's own cap,
        at least n_min), or an empty one. `tokens` are the sequence's cached tokens."""
        for d in self.drafters:
            cap = min(n_max, d.n_max)
            if cap <= 0:
                continue
            out = d.draft(seq_id, tokens, sampled, cap)
            if out.tokens:
                out.tokens, out.q = out.tokens[:cap], out.q[:cap]
                if len(out.tokens) < self.params.n_min:
                    return Draft([])
                out.source = d.name
                return out
        return Draft([])

    def forget(self, seq_id: int) -> None:
        """The sequence is gone (request done, slot cleared): drop what the drafters keep for it."""
        for d in self.drafters:
            d.forget(seq_id)
