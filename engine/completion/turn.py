"""A chat turn's data: what the turn brings into the cache (`TurnInput`), what it measured
(`TurnStats`, shown by /stats and --verbose), and the errors that refuse a message while the
conversation goes on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ubatch.engine.errors import UbatchError
from ubatch.engine.units import DecodeRates


class ChatInputError(UbatchError):
    """A message the conversation refuses (empty, too long); the conversation goes on."""


class ContextFullError(ChatInputError):
    """The conversation no longer fits the context and no context-shift policy is enabled."""


@dataclass(slots=True)
class TurnStats(DecodeRates):
    """One turn, as /stats and --verbose show it."""

    turn: int = 0
    n_turn: int = 0  # tokens the new turn added to the conversation (incl. an undecoded answer token)
    n_prompt: int = 0  # tokens evaluated (prefilled) this turn
    n_reused: int = 0  # conversation tokens found in the KV cache
    n_gen: int = 0  # answer tokens (the end-of-generation token not counted)
    n_eval: int = 0  # single-token decodes
    t_prompt_ms: float = 0.0
    t_eval_ms: float = 0.0
    stop_reason: str = ""  # "eog", "length", "context", "interrupted"
    n_past: int = 0  # tokens in the cache afterwards
    n_shifts: int = 0
    n_dropped: int = 0  # messages dropped to make room
    reprocess: str = ""  # why the conversation was tokenized whole ("" = the turn's delta only)
    prompt_text: str = ""  # the whole conversation, formatted
    turn_text: str = ""  # the formatted text this turn appended (whole prompt when reprocessed)
    answer: str = ""


@dataclass(slots=True)
class TurnInput:
    """The tokens a turn must bring into the cache, and why they were chosen."""

    messages: list[dict[str, Any]]  # the conversation with the new user message
    text: str  # messages formatted, with the generation prompt
    target: list[int]  # the tokens the cache must hold before sampling
    n_turn: int
    turn_text: str
    reprocess: str = ""
    n_dropped: int = 0
