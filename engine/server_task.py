"""What a server request becomes: task parameters (llama-server's request schema), the events a
task emits while it runs, and the translation of OpenAI request bodies into the native schema.

Nothing here knows about HTTP: a `RequestError` carries the status code and llama.cpp's error
type, and the HTTP layer turns it into `{"error": {"code", "message", "type"}}`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .units import tokens_per_second
from .sampling import LLAMA_DEFAULT_SEED, SamplerParams

INT32_MAX = 2**31 - 1


class RequestError(Exception):
    """A request llama-server would answer with an error JSON (4xx unless said otherwise)."""

    def __init__(self, message: str, code: int = 400, type: str = "invalid_request_error",
                 **extra: Any) -> None:
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
    n_discard: int = 0
    n_cache_reuse: int = 0
    n_cmpl: int = 1
    return_tokens: bool = False
    timings_per_token: bool = False

    def to_json(self) -> dict[str, Any]:
        """`generation_settings` / `/slots` params with llama.cpp's key names."""
        s = self.sampling
        return {
            "seed": s.seed, "temperature": s.temp, "top_k": s.top_k, "top_p": s.top_p,
            "min_p": s.min_p, "typical_p": 1.0, "repeat_last_n": s.repeat_last_n,
            "repeat_penalty": s.repeat_penalty, "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty, "stop": list(self.stop),
            "max_tokens": self.n_predict, "n_predict": self.n_predict, "n_keep": self.n_keep,
            "n_discard": self.n_discard, "ignore_eos": self.ignore_eos, "stream": self.stream,
            "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t}  # -inf: JSON null
                           for t, b in self.logit_bias],
            "n_probs": self.n_probs, "min_keep": s.min_keep, "cache_prompt": self.cache_prompt,
            "n_cache_reuse": self.n_cache_reuse, "samplers": _SAMPLERS,
            "timings_per_token": self.timings_per_token,
            "post_sampling_probs": self.post_sampling_probs,
        }


_SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]


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
class TokenProb:
    """The sampled token's log-probability and the top-n candidates (pre-sampling)."""

    id: int
    piece: bytes
    logprob: float
    top: list[tuple[int, bytes, float]]


@dataclass(slots=True)
class Timings:
    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0

    def to_json(self) -> dict[str, float | int]:
        """llama.cpp's `timings`; the first generated token is excluded from the rate."""
        pn, pms, gn, gms = self.prompt_n, self.prompt_ms, self.predicted_n - 1, self.predicted_ms
        return {
            "cache_n": self.cache_n, "prompt_n": pn, "prompt_ms": pms,
            "prompt_per_token_ms": pms / pn if pn else 0.0,
            "prompt_per_second": tokens_per_second(pn, pms),
            "predicted_n": self.predicted_n, "predicted_ms": gms,
            "predicted_per_token_ms": gms / gn if gn > 0 else 0.0,
            "predicted_per_second": tokens_per_second(max(gn, 0), gms),
        }


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
    def __init__(self) -> None:
        self._n, self._lock = 0, threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._n += 1
            return self._n - 1


# -- reading fields the way llama-server's schema does ------------------------------------------


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), "null" if v is None else type(v).__name__)


def _present(body: dict[str, Any], *keys: str) -> tuple[str, Any] | None:
    """The first key present with a non-null value (JSON null means 'use the default')."""
    for k in keys:
        if body.get(k) is not None:
            return k, body[k]
    return None


def get_int(body: dict[str, Any], keys: tuple[str, ...] | str, default: int,
            lo: int | None = None, hi: int | None = None) -> int:
    """An integer field with a hard limit: out of range is a 400, as server-schema.cpp."""
    hit = _present(body, *((keys,) if isinstance(keys, str) else keys))
    if hit is None:
        return default
    k, v = hit
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise RequestError(f"Field '{k}': expected an integer, got {_type_name(v)}")
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise RequestError(f"Field '{k}': expected an integer, got {v}")
        v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f"Field '{k}': Value must be between {lo} <= value <= {hi}, but got {v}")
    return v


def get_float(body: dict[str, Any], key: str, default: float, lo: float | None = None,
              hi: float | None = None) -> float:
    """A number field with a soft limit: clamped silently."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise RequestError(f"Field '{key}': expected a number, got {_type_name(v) if not isinstance(v, float) else v}")
    v = float(v)
    if lo is not None:
        v = max(lo, v)
    if hi is not None:
        v = min(hi, v)
    return v


def get_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"Field '{key}': expected a boolean, got {_type_name(v)}")
    return v


def get_stop(body: dict[str, Any], default: list[str]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return list(default)
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise RequestError("Field 'stop': expected a string or an array of strings")
    return [s for s in v if s] or list(default)


@dataclass(slots=True)
class ServerDefaults:
    """Server-wide values a request falls back to (llama-server's CLI flags)."""

    sampling: SamplerParams = field(default_factory=SamplerParams)
    n_predict: int = -1
    n_ctx_slot: int = 0
    n_parallel: int = 1
    n_vocab: int = 0
    cache_prompt: bool = True
    n_cache_reuse: int = 0
    stop: list[str] = field(default_factory=list)


def parse_params(body: dict[str, Any], d: ServerDefaults,
                 tokenize: Callable[[str], list[int]] | None = None,
                 eog: frozenset[int] = frozenset()) -> TaskParams:
    """params_from_json_cmpl: a native request body -> TaskParams (RequestError on bad input)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    ds = d.sampling
    seed = get_int(body, "seed", -1 if ds.seed == LLAMA_DEFAULT_SEED else ds.seed, -1, 0xFFFFFFFF)
    last_n = get_int(body, "repeat_last_n", ds.repeat_last_n, -1, INT32_MAX)
    sp = SamplerParams(
        temp=get_float(body, "temperature", ds.temp, 0.0),
        top_k=get_int(body, "top_k", ds.top_k, None, None),
        top_p=get_float(body, "top_p", ds.top_p, 0.0, 1.0),
        min_p=get_float(body, "min_p", ds.min_p, 0.0, 1.0),
        min_keep=max(0, get_int(body, "min_keep", ds.min_keep)),
        seed=LLAMA_DEFAULT_SEED if seed in (-1, LLAMA_DEFAULT_SEED) else seed,
        repeat_penalty=get_float(body, "repeat_penalty", ds.repeat_penalty),
        repeat_last_n=d.n_ctx_slot if last_n == -1 else last_n,
        frequency_penalty=get_float(body, "frequency_penalty", ds.frequency_penalty),
        presence_penalty=get_float(body, "presence_penalty", ds.presence_penalty),
    )
    sp.top_k = max(0, sp.top_k)
    n_probs = get_int(body, "n_probs", 0, 0, INT32_MAX)
    if n_probs == 0 and isinstance(body.get("logprobs"), int) and not isinstance(body["logprobs"], bool):
        n_probs = get_int(body, "logprobs", 0, 0, INT32_MAX)
    stream_opts = body.get("stream_options")
    if stream_opts is not None and not isinstance(stream_opts, dict):
        raise RequestError("Field 'stream_options': expected an object")
    p = TaskParams(
        n_predict=get_int(body, ("n_predict", "max_completion_tokens", "max_tokens"), d.n_predict, -1, INT32_MAX),
        sampling=sp,
        stop=get_stop(body, d.stop),
        n_probs=min(n_probs, d.n_vocab) if d.n_vocab else n_probs,
        post_sampling_probs=get_bool(body, "post_sampling_probs", False),
        ignore_eos=get_bool(body, "ignore_eos", False),
        stream=get_bool(body, "stream", False),
        include_usage=get_bool(stream_opts or {}, "include_usage", False),
        cache_prompt=get_bool(body, "cache_prompt", d.cache_prompt),
        id_slot=get_int(body, "id_slot", -1, -1, INT32_MAX),
        n_keep=get_int(body, "n_keep", 0, -1, INT32_MAX),
        n_discard=get_int(body, "n_discard", 0, 0, INT32_MAX),
        n_cache_reuse=get_int(body, "n_cache_reuse", d.n_cache_reuse, 0, INT32_MAX),
        n_cmpl=get_int(body, ("n_cmpl", "n"), 1, 1, max(1, d.n_parallel)),
        return_tokens=get_bool(body, "return_tokens", False),
        timings_per_token=get_bool(body, "timings_per_token", False),
    )
    p.logit_bias = _logit_bias(body.get("logit_bias"), d.n_vocab, tokenize)
    for unsupported in ("grammar", "json_schema"):
        if body.get(unsupported):
            raise RequestError(f"'{unsupported}' is not supported by this server (no grammar sampler)")
    return p


def _logit_bias(v: Any, n_vocab: int, tokenize: Callable[[str], list[int]] | None
                ) -> list[tuple[int, float]]:
    """llama-server's two forms: [[token|text, bias|false], ...] or {"token": bias}."""
    if v is None:
        return []
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list):
        items = [tuple(e) for e in v if isinstance(e, list) and len(e) == 2]
    else:
        raise RequestError("Field 'logit_bias': expected an object or an array of [token, bias] pairs")
    out: list[tuple[int, float]] = []
    for key, bias in items:
        if bias is False:
            b = -math.inf
        elif isinstance(bias, int | float) and not isinstance(bias, bool):
            b = float(bias)
        else:
            continue
        if isinstance(key, str) and key.lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool):
            if 0 <= key < n_vocab:
                out.append((key, b))
        elif isinstance(key, str) and tokenize is not None:
            out.extend((t, b) for t in tokenize(key))
    return out


# -- OpenAI bodies -> native bodies (oaicompat_*_params_parse) -----------------------------------


def oai_completion_body(body: Any) -> dict[str, Any]:
    """/v1/completions: llama-server rejects echo, best_of and suffix; max_tokens is n_predict."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "prompt" not in body:
        raise RequestError('"prompt" is required')
    if body.get("echo"):
        raise RequestError("Only no echo is supported")
    for k in ("best_of", "suffix"):
        if k in body:
            raise RequestError(f"Unsupported param: {k}")
    return dict(body)


def oai_chat_body(body: Any) -> dict[str, Any]:
    """/v1/chat/completions: logprobs -> n_probs = top_logprobs (default 20)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    msgs = body.get("messages")
    if msgs is None:
        raise RequestError("'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty array")
    out = dict(body)
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise RequestError(f"Field 'logprobs': expected a boolean, got {_type_name(lp)}")
    if lp:
        out["n_probs"] = get_int(body, "top_logprobs", 20, 0, 20)
    elif body.get("top_logprobs") is not None:
        raise RequestError("top_logprobs requires logprobs to be set to true")
    out.pop("logprobs", None)
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        raise RequestError("tools param requires --jinja flag")
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        raise RequestError(f"response_format type {rf.get('type')!r} is not supported by this server "
                           "(no grammar sampler)")
    return out


def chat_messages(msgs: list[Any]) -> list[dict[str, str]]:
    """Validated {role, content} messages; content parts of type text are joined."""
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}]: expected an object with a string 'role'")
        c = m.get("content")
        if c is None:
            c = ""
        elif isinstance(c, list):
            parts = []
            for p in c:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    kind = p.get("type") if isinstance(p, dict) else _type_name(p)
                    raise RequestError(f"messages[{i}]: content part of type {kind!r} is not supported "
                                       "(text only; this server has no multimodal projector)")
                parts.append(p["text"])
            c = "\n".join(parts)
        elif not isinstance(c, str):
            raise RequestError(f"messages[{i}].content: expected a string or an array of parts")
        out.append({"role": m["role"], "content": c})
    return out


def split_prompts(prompt: Any, name: str = "prompt") -> list[list[str | int]]:
    """llama.cpp's tokenize_input_prompts: a string, a token array or a mixed array is one
    prompt; an array of those is several prompts (one task each)."""
    def one(p: Any) -> list[str | int] | None:
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and all(isinstance(x, str) or _is_int(x) for x in p) \
                and any(_is_int(x) for x in p):
            return list(p)
        return None

    if (single := one(prompt)) is not None:
        return [single]
    if isinstance(prompt, list) and prompt:
        many = [one(p) for p in prompt]
        if all(m is not None for m in many):
            return many  # type: ignore[return-value]
    if isinstance(prompt, list) and not prompt:
        return [[]]
    raise RequestError(f'"{name}" must be a string, an array of token ids, or an array of prompts')


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def find_partial_stop(text: str, word: str) -> int:
    """Start of the longest suffix of `text` that is a proper prefix of `word`, or -1."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return len(text) - n
    return -1
