"""llama-server's response JSON for generation: native /completion, OpenAI text and chat
completions, their stream chunks, a task's settings and timings, and the error body. Pure
functions from the engine's data and events to dicts; the engine itself writes no JSON.

What a client gets back for its prompt is kept apart from the monitoring views of the server's
state (/slots, /metrics: cli/server/metrics.py)."""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Sequence
from typing import Any

from ubatch.engine.chat.tools.types import ChatDelta, ChatMessageOut
from ubatch.engine.generation.generation import TokenProb
from ubatch.engine.serve.task import Final, Partial, Progress, TaskParams, Timings
from ubatch.engine.units import tokens_per_second

FLT_LOWEST = -3.4028234663852886e38  # llama.cpp sends this instead of -inf (not valid JSON)
BUILD_INFO = "ubatch-0.1.0"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def error_json(code: int, message: str, type: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": type, **extra}}


def params_json(p: TaskParams) -> dict[str, Any]:
    """A task's settings with llama.cpp's key names: `generation_settings`, /slots' `params`,
    /props' defaults."""
    s = p.sampling
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
        "stop": list(p.stop),
        "max_tokens": p.n_predict,
        "n_predict": p.n_predict,
        "n_keep": p.n_keep,
        "n_discard": p.n_discard,
        "ignore_eos": p.ignore_eos,
        "stream": p.stream,
        "logit_bias": [
            {"bias": b if math.isfinite(b) else None, "token": t}  # -inf: JSON null
            for t, b in p.logit_bias
        ],
        "n_probs": p.n_probs,
        "min_keep": s.min_keep,
        "grammar": p.grammar.text if p.grammar is not None else "",
        "preserved_tokens": sorted(p.preserved),
        "cache_prompt": p.cache_prompt,
        "n_cache_reuse": p.n_cache_reuse,
        "samplers": list(s.samplers),
        "timings_per_token": p.timings_per_token,
        "post_sampling_probs": p.post_sampling_probs,
        "lora": [{"id": i, "scale": v} for i, v in sorted((p.lora or {}).items())],
    }


def timings_json(t: Timings) -> dict[str, float | int]:
    """llama.cpp's `timings`; the first generated token is excluded from the rate."""
    pn, pms, gn, gms = t.prompt_n, t.prompt_ms, t.predicted_n - 1, t.predicted_ms
    out: dict[str, float | int] = {
        "cache_n": t.cache_n,
        "prompt_n": pn,
        "prompt_ms": pms,
        "prompt_per_token_ms": pms / pn if pn else 0.0,
        "prompt_per_second": tokens_per_second(pn, pms),
        "predicted_n": t.predicted_n,
        "predicted_ms": gms,
        "predicted_per_token_ms": gms / gn if gn > 0 else 0.0,
        "predicted_per_second": tokens_per_second(max(gn, 0), gms),
    }
    if t.draft_n > 0:  # llama-server adds these only when something was drafted
        out["draft_n"], out["draft_n_accepted"] = t.draft_n, t.draft_n_accepted
    return out


def progress_json(ev: Progress) -> dict[str, int]:
    """A prompt_progress event's object (server-task.cpp result_prompt_progress)."""
    return {"total": ev.total, "cache": ev.cache, "processed": ev.processed, "time_ms": ev.time_ms}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="ignore")


def probs_json(probs: Sequence[TokenProb], post: bool = False) -> list[dict[str, Any]]:
    """completion_probabilities (also the `content` of OpenAI logprobs)."""

    def lp(v: float) -> float:
        return max(v, FLT_LOWEST)

    def one(i: int, piece: bytes, v: float) -> dict[str, Any]:
        return {
            "id": i,
            "token": _text(piece),
            "bytes": list(piece),
            **({"prob": 2.718281828459045**v} if post else {"logprob": lp(v)}),
        }

    return [
        {
            **one(p.id, p.piece, p.logprob),
            ("top_probs" if post else "top_logprobs"): [one(i, b, v) for i, b, v in p.top],
        }
        for p in probs
    ]


# -- native /completion ------------------------------------------------------------------------


def native_partial(ev: Partial) -> dict[str, Any]:
    p = ev.task.params
    res: dict[str, Any] = {
        "index": ev.task.index,
        "content": ev.text,
        "tokens": [ev.token],
        "stop": False,
        "id_slot": ev.id_slot,
        "tokens_predicted": ev.n_decoded,
        "tokens_evaluated": ev.n_prompt,
    }
    if ev.timings is not None:
        res["timings"] = timings_json(ev.timings)
    if ev.prob is not None:
        res["completion_probabilities"] = probs_json([ev.prob], p.post_sampling_probs)
    return res


def native_progress(ev: Progress) -> dict[str, Any]:
    """A prompt_progress chunk: a partial without text (llama-server sends token 0 with it)."""
    return {
        "index": ev.task.index,
        "content": "",
        "tokens": [0],
        "stop": False,
        "id_slot": ev.id_slot,
        "tokens_predicted": 0,
        "tokens_evaluated": ev.total,
        "prompt_progress": progress_json(ev),
    }


def native_final(ev: Final, model: str) -> dict[str, Any]:
    p = ev.task.params
    res = {
        "index": ev.task.index,
        "content": ev.content,
        "tokens": ev.tokens if p.return_tokens and not p.stream else [],
        "id_slot": ev.id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": ev.n_decoded,
        "tokens_evaluated": ev.n_prompt,
        "generation_settings": params_json(p),
        "prompt": ev.task.prompt_text,
        "has_new_line": ev.has_new_line,
        "truncated": ev.truncated,
        "stop_type": ev.stop_type,
        "stopping_word": ev.stopping_word,
        "tokens_cached": ev.n_cached,
        "timings": timings_json(ev.timings),
    }
    if not p.stream and ev.probs:
        res["completion_probabilities"] = probs_json(ev.probs, p.post_sampling_probs)
    return res


# -- OpenAI ---------------------------------------------------------------------------------------


def finish_reason(ev: Final) -> str:
    return "stop" if ev.stop_type in ("eos", "word") else "length"


def _usage(finals: list[Final]) -> dict[str, Any]:
    n_prompt = sum(f.n_prompt for f in finals if f.task.index % max(f.task.params.n_cmpl, 1) == 0)
    n_gen = sum(f.n_decoded for f in finals)
    cached = sum(f.timings.cache_n for f in finals)
    return {
        "completion_tokens": n_gen,
        "prompt_tokens": n_prompt,
        "total_tokens": n_gen + n_prompt,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _head(obj: str, cid: str, model: str) -> dict[str, Any]:
    return {"created": int(time.time()), "model": model, "system_fingerprint": BUILD_INFO, "object": obj, "id": cid}


def _logprobs(ev: Final | Partial) -> dict[str, Any] | None:
    probs = ev.probs if isinstance(ev, Final) else ([ev.prob] if ev.prob else [])
    if not probs:
        return None
    return {"content": probs_json(probs, ev.task.params.post_sampling_probs)}


def oai_completion(finals: list[Final], cid: str, model: str) -> dict[str, Any]:
    finals = sorted(finals, key=lambda f: f.task.index)
    choices = [
        {"text": f.content, "index": f.task.index, "logprobs": _logprobs(f), "finish_reason": finish_reason(f)}
        for f in finals
    ]
    return _final_body("text_completion", choices, finals, cid, model)


def _final_body(obj: str, choices: list[Any], finals: list[Final], cid: str, model: str) -> dict[str, Any]:
    """The OpenAI body of finished tasks: choices, id/model/object, usage and llama.cpp's timings."""
    body = {
        "choices": choices,
        **_head(obj, cid, model),
        "usage": _usage(finals),
        "timings": timings_json(finals[0].timings),
    }
    return _verbose(body, finals[0], model)


def _verbose(res: dict[str, Any], ev: Final | Partial, model: str) -> dict[str, Any]:
    """With "verbose": true an OpenAI body also carries the native one (llama-server's __verbose)."""
    if ev.task.params.verbose:
        res["__verbose"] = native_final(ev, model) if isinstance(ev, Final) else native_partial(ev)
    return res


def oai_completion_chunk(ev: Partial | Final | Progress, cid: str, model: str) -> list[dict[str, Any]]:
    if isinstance(ev, Progress):
        choice = {"text": "", "index": ev.task.index, "logprobs": None, "finish_reason": None}
        return [{"choices": [choice], **_head("text_completion", cid, model), "prompt_progress": progress_json(ev)}]
    if isinstance(ev, Partial):
        choice = {"text": ev.text, "index": ev.task.index, "logprobs": _logprobs(ev), "finish_reason": None}
        return [_verbose({"choices": [choice], **_head("text_completion", cid, model)}, ev, model)]
    out = [
        {
            "choices": [
                {"text": ev.content, "index": ev.task.index, "logprobs": None, "finish_reason": finish_reason(ev)}
            ],
            **_head("text_completion", cid, model),
            "usage": _usage([ev]),
            "timings": timings_json(ev.timings),
        }
    ]
    _verbose(out[0], ev, model)
    return out


def oai_chat(
    finals: list[Final], cid: str, model: str, messages: dict[int, ChatMessageOut] | None = None
) -> dict[str, Any]:
    """The chat completion body; `messages` are the parsed replies by choice index (tool calls,
    reasoning), else each choice's message is its text as generated."""
    finals = sorted(finals, key=lambda f: f.task.index)
    choices = []
    for f in finals:
        msg = (messages or {}).get(f.task.index)
        c: dict[str, Any] = {
            "finish_reason": chat_finish_reason(f, msg),
            "index": f.task.index,
            "message": msg.to_openai() if msg is not None else {"role": "assistant", "content": f.content},
        }
        if (lp := _logprobs(f)) is not None:
            c["logprobs"] = lp
        choices.append(c)
    return _final_body("chat.completion", choices, finals, cid, model)


def chat_finish_reason(ev: Final, msg: ChatMessageOut | None) -> str:
    """llama-server's: "tool_calls" when a reply that ended by itself made calls."""
    reason = finish_reason(ev)
    return "tool_calls" if reason == "stop" and msg is not None and msg.tool_calls else reason


def _chat_chunk(index: int, delta: dict[str, Any], cid: str, model: str, finish: str | None = None) -> dict[str, Any]:
    return {
        "choices": [{"finish_reason": finish, "index": index, "delta": delta}],
        **_head("chat.completion.chunk", cid, model),
    }


def oai_chat_chunks(
    ev: Partial | Final | Progress,
    cid: str,
    model: str,
    deltas: list[ChatDelta] | None = None,
    msg: ChatMessageOut | None = None,
) -> list[dict[str, Any]]:
    """The chunks one event becomes: a role delta first, then content deltas; at the end an
    empty delta with finish_reason and, with include_usage, a usage chunk. A prompt_progress
    event is a role delta carrying it. With `deltas` (the parsed output: reasoning, tool
    calls) those are sent instead of the event's text; `msg` is the parsed whole reply at the end."""
    i = ev.task.index
    if isinstance(ev, Progress):
        c = _chat_chunk(i, {"role": "assistant", "content": None}, cid, model)
        return [{**c, "prompt_progress": progress_json(ev)}]
    text = ev.text if isinstance(ev, Partial) else ev.content
    pieces = [d.to_openai() for d in deltas if d] if deltas is not None else ([{"content": text}] if text else [])
    out = []
    if ev.n_decoded == (1 if isinstance(ev, Partial) else 0):
        out.append(_chat_chunk(i, {"role": "assistant", "content": None}, cid, model))
    out += [_chat_chunk(i, d, cid, model) for d in pieces]
    if isinstance(ev, Partial):
        if out and (lp := _logprobs(ev)) is not None:
            out[-1]["choices"][0]["logprobs"] = lp
        if out and ev.timings is not None:
            out[-1]["timings"] = timings_json(ev.timings)
        return out
    out.append(_chat_chunk(i, {}, cid, model, chat_finish_reason(ev, msg)))
    if ev.task.params.include_usage:
        out.append({"choices": [], **_head("chat.completion.chunk", cid, model), "usage": _usage([ev])})
    out[-1]["timings"] = timings_json(ev.timings)
    _verbose(out[0], ev, model)
    return out
