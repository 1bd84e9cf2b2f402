"""llama.cpp's sampler chain (common/sampling.cpp): the stages in `samplers` order, then a draw.

The default order is penalties -> DRY -> top-n-sigma -> top-k -> typical -> top-p -> min-p ->
XTC -> temperature, then `dist`, a draw from the remaining candidates. A stage whose
parameters switch it off is left out of the chain, as llama.cpp's "empty" samplers are. With
--mirostat 1 or 2 the chain is only temperature -> mirostat (llama.cpp ignores the other
stages then). temp <= 0 is not a separate greedy mode: the temperature stage keeps only the
best token, so a stage before it can still matter (XTC, typical); when none can, the result
is the argmax after the logit penalties, taken without sorting anything.

Every random draw reproduces llama.cpp's (engine/sampling/rng.py): dist, mirostat and XTC each
own a std::mt19937 seeded with the seed, as each llama.cpp sampler seeds its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from ubatch.engine.errors import UbatchError
from ubatch.engine.sampling import stages as S
from ubatch.engine.sampling.batched import RowChain, row_chain
from ubatch.engine.sampling.dry import Dry, breaker_table
from ubatch.engine.sampling.mirostat import Mirostat
from ubatch.engine.sampling.names import DEFAULT_SAMPLERS, SAMPLER_CHARS, UNSUPPORTED_SAMPLERS
from ubatch.engine.sampling.reasoning_budget import ReasoningBudget
from ubatch.engine.sampling.rng import LLAMA_DEFAULT_SEED, Mt19937, resolve_seed
from ubatch.engine.sampling.stages import Cands, f32

if TYPE_CHECKING:
    from ubatch.engine.vocab.vocab import Vocab

__all__ = ["LLAMA_DEFAULT_SEED", "Sampler", "SamplerParams"]

Stage = Callable[[Cands], Cands]
_LOGIT_MODIFIERS = ("penalties", "dry")  # change logits, keep every candidate
_KEEP_BEST = ("top_k", "top_p", "min_p", "top_n_sigma")  # drop candidates, never the best one


@dataclass(slots=True)
class SamplerParams:
    """common_params_sampling's sampler fields, with llama.cpp's defaults."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    min_keep: int = 0
    seed: int = LLAMA_DEFAULT_SEED  # default / negative = random
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # 0 disables the penalties; -1 (ubatch's): the whole history
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    typ_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat: int = 0  # 0 off, 1 mirostat, 2 mirostat 2.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # 0 disables DRY; -1: the context size (the Sampler's n_ctx)
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    # the reasoning budget (engine/sampling/reasoning_budget.py): -1 unlimited, else the tokens
    # a thinking block may take before its end is forced; the message is text (the server's
    # default), the rest token ids the HTTP layer tokenized from the template's tags
    reasoning_budget_tokens: int = -1
    reasoning_budget_message: str = ""
    reasoning_budget_start: tuple[int, ...] = ()  # the thinking start tag
    reasoning_budget_end: tuple[tuple[int, ...], ...] = ()  # the end tags (the first is forced)
    reasoning_budget_forced: tuple[int, ...] = ()  # the message, then the first end tag
    reasoning_budget_prefill: tuple[int, ...] = ()  # the generation prompt, fed before generating

    def reasoning_budget(self, vocab: Vocab | None = None) -> ReasoningBudget | None:
        """The budget stage these parameters ask for, primed with the generation prompt (None:
        no budget, or no tags to watch for, as common_sampler_init decides)."""
        if self.reasoning_budget_tokens < 0 or not self.reasoning_budget_start or not self.reasoning_budget_end:
            return None
        budget = ReasoningBudget(
            self.reasoning_budget_tokens,
            self.reasoning_budget_start,
            self.reasoning_budget_end,
            self.reasoning_budget_forced,
            vocab,
        )
        for t in self.reasoning_budget_prefill:
            budget.accept(t)
        return budget


class Sampler:
    """One sequence's sampler: `accept` every prompt and generated token, `sample` each row.

    `n_ctx` is what dry_penalty_last_n = -1 means (0: the whole history); `vocab` turns DRY's
    sequence breakers (text) into tokens; without it DRY runs without breakers.
    """

    def __init__(self, params: SamplerParams | None = None, n_ctx: int = 0, vocab: Vocab | None = None) -> None:
        self.params = p = params or SamplerParams()
        self.rng = Mt19937(resolve_seed(p.seed))  # dist's (or mirostat's) generator
        self.seed = self.rng.seed
        self._stages: list[tuple[str, Stage]] = []
        self._accept: list[Callable[[int], None]] = []
        self._final: Callable[[Cands], int]
        if p.mirostat == 0:
            for name in p.samplers:
                self._add(name, n_ctx, vocab)
            self._final = partial(S.dist, rng=self.rng)
        elif p.mirostat in (1, 2):
            if f32(p.temp) != 1.0:
                self._stages.append(("temperature", partial(S.scale, temp=p.temp)))
            self._final = Mirostat(p.mirostat, p.mirostat_tau, p.mirostat_eta, self.rng)
        else:
            raise UbatchError(f"mirostat must be 0 (off), 1 or 2, not {p.mirostat}")
        self._greedy = self._greedy_stages()
        self.row_chain = self._row_chain()  # the batched pass's form of this chain (None: this row alone)
        # applied before everything else, as common_sampler_sample applies it (its forced token
        # goes through the chain, the grammar and every draw like any other)
        self.budget = p.reasoning_budget(vocab)
        # greedy without logit modifiers nor a budget: one numpy argmax, no torch op (nor its thread pool)
        self.argmax_only = self._greedy == [] and self.budget is None

    def _add(self, name: str, n_ctx: int, vocab: Vocab | None) -> None:
        p = self.params
        stage: Stage | None = None
        if name == "penalties":
            neutral = f32(p.repeat_penalty) == 1.0 and f32(p.frequency_penalty) == 0 and f32(p.presence_penalty) == 0
            if p.repeat_last_n != 0 and not neutral:
                pen = S.Penalties(p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)
                self._accept.append(pen.accept)
                stage = pen
        elif name == "dry":
            last_n = (n_ctx or None) if p.dry_penalty_last_n < 0 else p.dry_penalty_last_n
            if f32(p.dry_multiplier) != 0 and f32(p.dry_base) >= 1.0 and last_n != 0:
                table = breaker_table(vocab, tuple(p.dry_sequence_breakers))
                dry = Dry(p.dry_multiplier, p.dry_base, p.dry_allowed_length, last_n, table)
                self._accept.append(dry.accept)
                stage = dry
        elif name == "top_n_sigma":
            if f32(p.top_n_sigma) > 0:
                stage = partial(S.top_n_sigma, n=p.top_n_sigma)
        elif name == "top_k":
            if p.top_k > 0:
                stage = partial(S.top_k, k=p.top_k)
        elif name == "typ_p":
            if f32(p.typ_p) < 1.0:
                stage = partial(S.typical, p=p.typ_p, min_keep=p.min_keep)
        elif name == "top_p":
            if f32(p.top_p) < 1.0:
                stage = partial(S.top_p, p=p.top_p, min_keep=p.min_keep)
        elif name == "min_p":
            if f32(p.min_p) > 0:
                stage = partial(S.min_p, p=p.min_p, min_keep=p.min_keep)
        elif name == "xtc":
            if f32(p.xtc_probability) > 0 and f32(p.xtc_threshold) <= 0.5:
                stage = S.Xtc(p.xtc_probability, p.xtc_threshold, p.min_keep, Mt19937(resolve_seed(p.seed)))
        elif name == "temperature":
            if f32(p.dynatemp_range) > 0:
                stage = partial(S.temperature, temp=p.temp, delta=p.dynatemp_range, exponent=p.dynatemp_exponent)
            elif f32(p.temp) != 1.0:
                stage = partial(S.scale, temp=p.temp)
        elif name in UNSUPPORTED_SAMPLERS:
            raise UbatchError(f"sampler '{name}' is not supported by ubatch")
        else:
            raise UbatchError(f"unknown sampler '{name}' (valid: {', '.join(SAMPLER_CHARS)})")
        if stage is not None:
            self._stages.append((name, stage))

    def _greedy_stages(self) -> list[Stage] | None:
        """The logit modifiers to run before an argmax, when the chain is greedy in effect:
        temp <= 0 and nothing before the temperature can drop the best token or change the
        logits after a filter did. None: run the whole chain."""
        p = self.params
        if p.mirostat or f32(p.temp) > 0 or f32(p.dynatemp_range) > 0:
            return None
        mods: list[Stage] = []
        filtered = False
        for name, stage in self._stages:
            if name == "temperature":
                return mods
            if name in _LOGIT_MODIFIERS and not filtered:
                mods.append(stage)
            elif name in _KEEP_BEST:
                filtered = True
            else:
                return None
        return None  # no temperature stage: llama.cpp draws at temperature 1

    def _row_chain(self) -> RowChain | None:
        p = self.params
        if p.mirostat:
            return None
        pen = next((st for n, st in self._stages if isinstance(st, S.Penalties)), None)
        if self._greedy is not None:
            names = ["penalties" if isinstance(m, S.Penalties) else "other" for m in self._greedy]
        else:
            names = [n for n, _ in self._stages]
        return row_chain(
            names,
            pen,
            self._greedy is not None,
            p.top_k,
            p.top_p,
            p.min_p,
            p.min_keep,
            p.temp,
            f32(p.dynatemp_range) > 0,
        )

    def accept(self, token: int, generated: bool = True) -> None:
        """Feed a token into the penalty and DRY histories (prompt tokens and each sampled one);
        only generated tokens move the reasoning budget."""
        for accept in self._accept:
            accept(token)
        if generated and self.budget is not None:
            self.budget.accept(token)

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """The row with the reasoning budget applied: while it forces a token, that token alone
        keeps a finite logit. Callers apply it once per row, before the draw (and the grammar)."""
        return logits if self.budget is None else self.budget.apply(logits)

    def sample(self, logits: torch.Tensor) -> int:
        c = Cands(logits.float())
        if self._greedy is not None:
            for stage in self._greedy:
                c = stage(c)
            return S.first_best(c.logits)
        for _, stage in self._stages:
            c = stage(c)
        return self._final(c)

    def distribution(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The candidates the final draw chooses from and their probabilities, for speculative
        rejection sampling. None when the chain is not "stages, then dist" without other draws
        (greedy in effect, mirostat, XTC): those are verified by sampling and matching."""
        if self._greedy is not None or self.params.mirostat or any(n == "xtc" for n, _ in self._stages):
            return None
        c = Cands(logits.float())
        for _, stage in self._stages:
            c = stage(c)
        ids = torch.arange(c.size) if c.ids is None else c.ids
        return ids, torch.softmax(c.logits.double(), 0)
