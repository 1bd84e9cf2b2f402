"""What a server request becomes inside the engine: its task parameters, the events a running
task emits, and the errors it can end with.

The scheduler and the HTTP layer share these types, so they live in the engine; reading HTTP
bodies into them is the HTTP layer's job (cli/server_params.py). Nothing here knows about HTTP:
a `RequestError` carries the status code and llama.cpp's error type, and the HTTP layer turns
it into `{"error": {"code", "message", "type"}}`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ubatch.engine.generation.generation import TokenProb
from ubatch.engine.grammar import Grammar
from ubatch.engine.sampling.chain import SamplerParams
from ubatch.engine.units import tokens_per_second

INT32_MAX = 2**31 - 1


class RequestError(Exception):
    """A request llama-server would answer with an error JSON (4xx unless said otherwise)."""

    def __init__(self, message: str, code: int = 400, type: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.message, self.code, self.type, self.extra = message, code, type, extra


@dataclass(slots=True)
class TaskParams:
    """One completion's settings (server-task.cpp `task_params`)."""

    n_predict: int = -1
    sampling: SamplerParams = field(default_factory=SamplerParams)
    stop: list[str] = field(default_factory=list)
    n_probs: int = 0
    post_sampling_probs: bool = False
    ignore_eos: bool = False
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_prompt: bool = True
    id_slot: int = -1
    n_keep: int = 0
    special: bool = False  # the server's -sp: control tokens appear in the text
    n_discard: int = 0
    n_cache_reuse: int = 0
    n_cmpl: int = 1
    return_tokens: bool = False
    timings_per_token: bool = False
    return_progress: bool = False  # prompt_progress events in a stream
    verbose: bool = False  # __verbose (the native body) in OpenAI responses
    grammar: Grammar | None = None  # compiled by the HTTP layer (grammar, json_schema, response_format)

    def to_json(self) -> dict[str, Any]:
        """`generation_settings` / `/slots` params with llama.cpp's key names."""
        s = self.sampling
        return {
            "seed": s.seed,
            "temperature": s.temp,
            "dynatemp_range": s.dynatemp_range,
            "dynatemp_exponent": s.dynatemp_exponent,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": s.min_p,
            "top_n_sigma": s.top_n_sigma,
            "xtc_probability": s.xtc_probability,
            "xtc_threshold": s.xtc_threshold,
            "typical_p": s.typ_p,
            "repeat_last_n": s.repeat_last_n,
            "repeat_penalty": s.repeat_penalty,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "dry_multiplier": s.dry_multiplier,
            "dry_base": s.dry_base,
            "dry_allowed_length": s.dry_allowed_length,
            "dry_penalty_last_n": s.dry_penalty_last_n,
            "dry_sequence_breakers": list(s.dry_sequence_breakers),
            "mirostat": s.mirostat,
            "mirostat_tau": s.mirostat_tau,
            "mirostat_eta": s.mirostat_eta,
            "stop": list(self.stop),
            "max_tokens": self.n_predict,
            "n_predict": self.n_predict,
            "n_keep": self.n_keep,
            "n_discard": self.n_discard,
            "ignore_eos": self.ignore_eos,
            "stream": self.stream,
            "logit_bias": [
                {"bias": b if math.isfinite(b) else None, "token": t}  # -inf: JSON null
                for t, b in self.logit_bias
            ],
            "n_probs": self.n_probs,
            "min_keep": s.min_keep,
            "grammar": self.grammar.text if self.grammar is not None else "",
            "cache_prompt": self.cache_prompt,
            "n_cache_reuse": self.n_cache_reuse,
            "samplers": list(s.samplers),
            "timings_per_token": self.timings_per_token,
            "post_sampling_probs": self.post_sampling_probs,
        }


@dataclass(slots=True)
class Task:
    """A queued or running completion. `sink` receives its events from the engine thread."""

    id: int
    prompt: list[int]
    params: TaskParams
    sink: Callable[[Any], None]
    index: int = 0  # choice index when one request fans out into several tasks
    prompt_text: str = ""
    cancelled: bool = False
    cancel_iteration: int = -1  # scheduler iteration at which cancel() was called

    def emit(self, event: Any) -> None:
        if not self.cancelled:
            self.sink(event)


@dataclass(slots=True)
class Timings:
    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0  # speculative decoding: tokens drafted, and accepted by the target
    draft_n_accepted: int = 0

    def to_json(self) -> dict[str, float | int]:
        """llama.cpp's `timings`; the first generated token is excluded from the rate."""
        pn, pms, gn, gms = self.prompt_n, self.prompt_ms, self.predicted_n - 1, self.predicted_ms
        out: dict[str, float | int] = {
            "cache_n": self.cache_n,
            "prompt_n": pn,
            "prompt_ms": pms,
            "prompt_per_token_ms": pms / pn if pn else 0.0,
            "prompt_per_second": tokens_per_second(pn, pms),
            "predicted_n": self.predicted_n,
            "predicted_ms": gms,
            "predicted_per_token_ms": gms / gn if gn > 0 else 0.0,
            "predicted_per_second": tokens_per_second(max(gn, 0), gms),
        }
        if self.draft_n > 0:  # llama-server adds these only when something was drafted
            out["draft_n"], out["draft_n_accepted"] = self.draft_n, self.draft_n_accepted
        return out


@dataclass(slots=True)
class Partial:
    """One sampled token of a streaming task; `text` is what may be sent now."""

    task: Task
    id_slot: int
    token: int
    text: str
    n_decoded: int
    n_prompt: int
    prob: TokenProb | None = None
    timings: Timings | None = None


@dataclass(slots=True)
class Final:
    task: Task
    id_slot: int
    content: str  # the whole text (for streams: only what was not yet sent)
    tokens: list[int]
    n_decoded: int
    n_prompt: int
    n_cached: int
    stop_type: str  # "none" | "eos" | "word" | "limit"
    stopping_word: str
    truncated: bool
    has_new_line: bool
    timings: Timings
    probs: list[TokenProb] = field(default_factory=list)


@dataclass(slots=True)
class Failed:
    task: Task
    error: RequestError


class IdCounter:
    """Task ids (llama-server's id_task), unique across the HTTP handlers' threads."""

    def __init__(self) -> None:
        self._n, self._lock = 0, threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._n += 1
            return self._n - 1


def context_error(n_prompt: int, n_ctx: int, at_least: bool = False) -> RequestError | None:
    """llama-server's exceed_context_size_error when a prompt leaves no room to generate;
    `at_least`: n_prompt is a lower bound (the prompt was refused before it was tokenized)."""
    if n_prompt < n_ctx:
        return None
    return RequestError(
        f"request ({'at least ' if at_least else ''}{n_prompt} tokens) exceeds the available context size"
        f" ({n_ctx} tokens), try increasing it",
        400,
        "exceed_context_size_error",
        n_prompt_tokens=n_prompt,
        n_ctx=n_ctx,
    )
