"""llama.cpp's speculative-decoding flags, declared once for `ubatch cli`, `ubatch server` and
`ubatch explain`: `@spec_options` adds them to a command and hands it one `SpecFlags`, which
checks them before anything loads, loads the draft model and builds the engine's `Speculator`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from ubatch.cli.flag_group import flag, flag_group
from ubatch.cli.validate import DEFAULT_KV_TYPE
from ubatch.engine.errors import UbatchError

PANEL = "Speculative decoding"


_flag = functools.partial(flag, panel=PANEL)


@dataclass
class SpecFlags:
    """The flags as typed (llama.cpp's names and defaults)."""

    model_draft: Optional[Path] = _flag(
        None, "-md", "--model-draft", "--spec-draft-model", help="draft model (GGUF) for draft-simple"
    )
    spec_type: Optional[list[str]] = _flag(
        None, "--spec-type", help="drafters, comma-separated: ngram-simple, draft-simple, none"
    )
    spec_draft_n_max: int = _flag(3, "--spec-draft-n-max", help="tokens the draft model drafts")
    spec_draft_n_min: int = _flag(0, "--spec-draft-n-min", help="shorter drafts are dropped")
    spec_draft_p_min: float = _flag(
        0.0, "--spec-draft-p-min", "--draft-p-min", help="stop drafting below this probability"
    )
    spec_draft_sampling: str = _flag(
        "greedy", "--spec-draft-sampling", help="greedy, or probabilistic (rejection sampling)"
    )
    spec_ngram_simple_size_n: int = _flag(12, "--spec-ngram-simple-size-n", help="ngram-simple: tokens looked up")
    spec_ngram_simple_size_m: int = _flag(48, "--spec-ngram-simple-size-m", help="ngram-simple: tokens drafted at most")
    spec_ngram_simple_min_hits: int = _flag(1, "--spec-ngram-simple-min-hits", help="ngram-simple: hits needed")
    spec_draft_type_k: str = _flag(
        DEFAULT_KV_TYPE, "-ctkd", "--spec-draft-type-k", "--cache-type-k-draft", help="draft KV type for K"
    )
    spec_draft_type_v: str = _flag(
        DEFAULT_KV_TYPE, "-ctvd", "--spec-draft-type-v", "--cache-type-v-draft", help="draft KV type for V"
    )

    def types(self) -> tuple[str, ...]:
        """--spec-type values: comma lists, repeatable, in the order given (as llama.cpp appends)."""
        return tuple(t.strip() for v in self.spec_type or [] for t in v.split(",") if t.strip())

    def params(self) -> Any:
        from ubatch.engine.spec.speculative import SpecParams

        return SpecParams(
            types=self.types(),
            n_max=self.spec_draft_n_max,
            n_min=self.spec_draft_n_min,
            p_min=self.spec_draft_p_min,
            probabilistic=self.spec_draft_sampling == "probabilistic",
            ngram_size_n=self.spec_ngram_simple_size_n,
            ngram_size_m=self.spec_ngram_simple_size_m,
            ngram_min_hits=self.spec_ngram_simple_min_hits,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.params().enabled)

    @property
    def uses_draft_model(self) -> bool:
        return "draft-simple" in self.types()

    def check(self) -> list[str]:
        """Every value checked before anything loads; returns the notices to print. The commands
        call this before their context checks, so it reads the engine's KV types (a table that
        loads torch) only for a draft type other than the default: `-np 0` still answers at once."""
        if self.spec_draft_sampling not in ("greedy", "probabilistic"):
            raise UbatchError(
                f"--spec-draft-sampling {self.spec_draft_sampling}: invalid value, must be one of: greedy, probabilistic"
            )
        if self.spec_ngram_simple_min_hits < 1:
            raise UbatchError("--spec-ngram-simple-min-hits must be at least 1")
        for name, v in (("-ctkd", self.spec_draft_type_k), ("-ctvd", self.spec_draft_type_v)):
            if v != DEFAULT_KV_TYPE:
                from ubatch.engine.params import KV_TYPES

                if v not in KV_TYPES:
                    raise UbatchError(f"{name} {v}: unsupported KV cache type; use one of {', '.join(KV_TYPES)}")
        p = self.params()
        p.check()
        notes = []
        if self.uses_draft_model:
            if self.model_draft is None:
                raise UbatchError("--spec-type draft-simple needs a draft model: give it with -md FILE")
            if p.n_max == 0:
                raise UbatchError(
                    "--spec-draft-n-max 0 leaves the draft model nothing to draft; use 1 or more (default 3)"
                )
            if not self.model_draft.exists():
                raise UbatchError(f"draft model not found: {self.model_draft} (-md); give the path of a GGUF file")
        elif self.model_draft is not None:
            notes.append(
                f"notice: -md {self.model_draft}: not loaded, since --spec-type does not include draft-simple "
                "(llama.cpp needs both; add --spec-type draft-simple)"
            )
        return notes

    def build(self, ctx: Any) -> Any:
        """The Speculator for a target context (None when speculation is off); the draft model gets
        its own context with the target's n_ctx, batch sizes and sequences (n_outputs_max = them)."""
        if not self.enabled:
            return None
        from ubatch.engine.context.context import Context
        from ubatch.engine.model.model import Model
        from ubatch.engine.spec.draft import create_speculator

        draft_ctx = None
        if self.uses_draft_model:
            assert self.model_draft is not None  # check() refused draft-simple without -md
            dm = Model.load(self.model_draft, ctx.model.device)
            draft = replace(
                ctx.params,
                n_ctx=ctx.cparams.n_ctx,  # the target's, resolved: not the draft model's own
                n_outputs_max=min(ctx.params.n_batch, ctx.params.n_seq_max),
                type_k=self.spec_draft_type_k,
                type_v=self.spec_draft_type_v,
                swa_full=False,
            )
            draft_ctx = Context(dm, draft)
        return create_speculator(self.params(), ctx, draft_ctx)


# Add the speculative flags to a command; it receives them as `spec: SpecFlags`.
spec_options = flag_group(SpecFlags, "spec")
