"""What a server request becomes inside the engine: the tasks the engine loop takes, a
completion's parameters, and the events a running task emits.

The scheduler and the HTTP layer share these types, so they live in the engine; reading request
bodies into them and writing them as llama-server's JSON is the HTTP layer's (cli/server/). A
task that fails gets a `Failed` event carrying an `EngineError`, whose kind the HTTP layer turns
into a status code; nothing here knows about HTTP. A completion's events are one typed union,
`Event` (`Partial | Final | Failed | Progress`), frozen: the engine thread builds each one whole
and the HTTP thread that reads it gets a value nobody changes afterwards (a route that adds to a
text, as a continued assistant message does, makes a new event with `dataclasses.replace`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from ubatch.engine.errors import EngineError, ErrorKind
from ubatch.engine.generation.generation import TokenProb
from ubatch.engine.grammar import Grammar
from ubatch.engine.kv.memory import DecodeError, DecodeStatus
from ubatch.engine.sampling.chain import SamplerParams

INT32_MAX = 2**31 - 1

Sink = Callable[[object], None]  # where a task's events go; called on the engine thread


class Job(Protocol):
    """What the engine loop's door takes: a task with an id, the sink of its events, and the
    flag the HTTP side sets when the client went away (events then go nowhere). The task types
    (completions here, embeddings and slot files beside their runners) are dataclasses that
    declare these fields and inherit `emit` and `fail`."""

    id: int
    sink: Sink
    cancelled: bool
    cancel_iteration: int  # the scheduler's iteration when it was cancelled (-1: it was not)

    def emit(self, event: object) -> None:
        if not self.cancelled:
            self.sink(event)

    def fail(self, error: EngineError) -> None:
        self.emit(Failed(self, error))


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
    preserved: frozenset[int] = frozenset()  # control tokens shown anyway (llama-server's preserved_tokens)
    n_discard: int = 0
    n_cache_reuse: int = 0
    n_cmpl: int = 1
    return_tokens: bool = False
    timings_per_token: bool = False
    return_progress: bool = False  # prompt_progress events in a stream
    verbose: bool = False  # __verbose (the native body) in OpenAI responses
    grammar: Grammar | None = None  # compiled by the HTTP layer (grammar, json_schema, response_format)
    # the request's `lora` ({id: scale}, unlisted adapters at 0); None: the server's global scales
    lora: dict[int, float] | None = None


@dataclass(slots=True, eq=False)
class Task(Job):
    """A queued or running completion."""

    id: int
    prompt: list[int]
    params: TaskParams
    sink: Sink
    index: int = 0  # choice index when one request fans out into several tasks
    prompt_text: str = ""
    cancelled: bool = False
    cancel_iteration: int = -1


@dataclass(frozen=True, slots=True)
class Timings:
    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0  # speculative decoding: tokens drafted, and accepted by the target
    draft_n_accepted: int = 0


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class Final:
    """The end of a completion: its text, tokens, why it stopped and its timings."""

    task: Task
    id_slot: int
    content: str  # the whole text (for streams: only what was not yet sent)
    tokens: tuple[int, ...]
    n_decoded: int
    n_prompt: int
    n_cached: int
    stop_type: str  # "none" | "eos" | "word" | "limit"
    stopping_word: str
    truncated: bool
    has_new_line: bool
    timings: Timings
    probs: tuple[TokenProb, ...] = ()


@dataclass(frozen=True, slots=True)
class Failed:
    """A task that ends without a result (also a side runner's): the error names its kind."""

    task: Job
    error: EngineError


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a streamed task's prompt has been read (server-task.cpp result_prompt_progress)."""

    task: Task
    id_slot: int
    total: int  # prompt tokens
    cache: int  # of which were found in the slot's cache
    processed: int  # tokens in the slot's cells so far (cached + evaluated)
    time_ms: int  # since the task started on its slot


Event = Partial | Final | Failed | Progress  # what a completion task emits

TextEvent = TypeVar("TextEvent", bound=Partial | Final)


def with_prefill(ev: TextEvent, prefill: str) -> TextEvent:
    """The event with `prefill` (a continued assistant message) before its text: a new event."""
    if not prefill:
        return ev
    if isinstance(ev, Partial):
        return replace(ev, text=prefill + ev.text)
    return replace(ev, content=prefill + ev.content)


class IdCounter:
    """Task ids (llama-server's id_task), unique across the HTTP handlers' threads."""

    def __init__(self) -> None:
        self._n, self._lock = 0, threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._n += 1
            return self._n - 1


def context_error(n_prompt: int, n_ctx: int, at_least: bool = False) -> EngineError | None:
    """llama-server's exceed_context_size_error when a prompt leaves no room to generate;
    `at_least`: n_prompt is a lower bound (the prompt was refused before it was tokenized)."""
    if n_prompt < n_ctx:
        return None
    return EngineError(
        ErrorKind.EXCEEDS_CONTEXT,
        f"request ({'at least ' if at_least else ''}{n_prompt} tokens) exceeds the available context size"
        f" ({n_ctx} tokens), try increasing it",
        n_prompt_tokens=n_prompt,
        n_ctx=n_ctx,
    )


def decode_failure(e: Exception) -> EngineError:
    """What the tasks of a decode call that raised are told (llama-server's messages): no room
    left in the KV cache, a batch the context refused, or a failure while computing."""
    if isinstance(e, DecodeError):
        return EngineError(
            ErrorKind.INTERNAL,
            "Context size has been exceeded." if e.code is DecodeStatus.NO_KV_SLOT else f"Invalid input batch. ({e})",
        )
    return EngineError(ErrorKind.INTERNAL, f"Compute error. ({e})")
