"""llama-server's response JSON: native /completion, OpenAI text and chat completions, /slots,
/metrics. Pure functions from the scheduler's events and records to dicts and text."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from ..engine.generation import TokenProb
from ..engine.scheduler import Scheduler, Slot
from ..engine.server_task import Final, Partial
from ..engine.units import tokens_per_second

FLT_LOWEST = -3.4028234663852886e38  # llama.cpp sends this instead of -inf (not valid JSON)
BUILD_INFO = "ubatch-0.1.0"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def error_json(code: int, message: str, type: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": type, **extra}}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="ignore")


def probs_json(probs: list[TokenProb], post: bool = False) -> list[dict[str, Any]]:
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
        res["timings"] = ev.timings.to_json()
    if ev.prob is not None:
        res["completion_probabilities"] = probs_json([ev.prob], p.post_sampling_probs)
    return res


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
        "generation_settings": p.to_json(),
        "prompt": ev.task.prompt_text,
        "has_new_line": ev.has_new_line,
        "truncated": ev.truncated,
        "stop_type": ev.stop_type,
        "stopping_word": ev.stopping_word,
        "tokens_cached": ev.n_cached,
        "timings": ev.timings.to_json(),
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
    return {
        "choices": choices,
        **_head("text_completion", cid, model),
        "usage": _usage(finals),
        "timings": finals[0].timings.to_json(),
    }


def oai_completion_chunk(ev: Partial | Final, cid: str, model: str) -> list[dict[str, Any]]:
    if isinstance(ev, Partial):
        return [
            {
                "choices": [
                    {"text": ev.text, "index": ev.task.index, "logprobs": _logprobs(ev), "finish_reason": None}
                ],
                **_head("text_completion", cid, model),
            }
        ]
    out = [
        {
            "choices": [
                {"text": ev.content, "index": ev.task.index, "logprobs": None, "finish_reason": finish_reason(ev)}
            ],
            **_head("text_completion", cid, model),
            "usage": _usage([ev]),
            "timings": ev.timings.to_json(),
        }
    ]
    return out


def oai_chat(finals: list[Final], cid: str, model: str) -> dict[str, Any]:
    finals = sorted(finals, key=lambda f: f.task.index)
    choices = []
    for f in finals:
        c: dict[str, Any] = {
            "finish_reason": finish_reason(f),
            "index": f.task.index,
            "message": {"role": "assistant", "content": f.content},
        }
        if (lp := _logprobs(f)) is not None:
            c["logprobs"] = lp
        choices.append(c)
    return {
        "choices": choices,
        **_head("chat.completion", cid, model),
        "usage": _usage(finals),
        "timings": finals[0].timings.to_json(),
    }


def _chat_chunk(index: int, delta: dict[str, Any], cid: str, model: str, finish: str | None = None) -> dict[str, Any]:
    return {
        "choices": [{"finish_reason": finish, "index": index, "delta": delta}],
        **_head("chat.completion.chunk", cid, model),
    }


def oai_chat_chunks(ev: Partial | Final, cid: str, model: str) -> list[dict[str, Any]]:
    """The chunks one event becomes: a role delta first, then content deltas; at the end an
    empty delta with finish_reason and, with include_usage, a usage chunk."""
    i = ev.task.index
    if isinstance(ev, Partial):
        out = []
        if ev.n_decoded == 1:
            out.append(_chat_chunk(i, {"role": "assistant", "content": None}, cid, model))
        if ev.text:
            out.append(_chat_chunk(i, {"content": ev.text}, cid, model))
        if out and (lp := _logprobs(ev)) is not None:
            out[-1]["choices"][0]["logprobs"] = lp
        if out and ev.timings is not None:
            out[-1]["timings"] = ev.timings.to_json()
        return out
    out = []
    if ev.n_decoded == 0:
        out.append(_chat_chunk(i, {"role": "assistant", "content": None}, cid, model))
    if ev.content:
        out.append(_chat_chunk(i, {"content": ev.content}, cid, model))
    out.append(_chat_chunk(i, {}, cid, model, finish_reason(ev)))
    if ev.task.params.include_usage:
        out.append({"choices": [], **_head("chat.completion.chunk", cid, model), "usage": _usage([ev])})
    out[-1]["timings"] = ev.timings.to_json()
    return out


# -- /slots, /props, /metrics -----------------------------------------------------------------


def slot_json(s: Slot, detokenize: Any) -> dict[str, Any]:
    task = s.task or s.last_task
    res: dict[str, Any] = {
        "id": s.id,
        "n_ctx": s.n_ctx,
        "speculative": False,
        "is_processing": s.busy,
        "state": s.state.value,
        "n_cache_tokens": len(s.cache),
    }
    if task is not None:
        p = task.params
        n_remain = p.n_predict - s.n_decoded if p.n_predict >= 0 else -1
        res.update(
            {
                "id_task": task.id,
                "n_prompt_tokens": len(task.prompt),
                "n_prompt_tokens_processed": s.n_prompt_done,
                "n_prompt_tokens_cache": s.n_prompt_cache,
                "params": p.to_json(),
                "next_token": [
                    {
                        "has_next_token": s.busy,
                        "has_new_line": s.has_new_line,
                        "n_remain": n_remain,
                        "n_decoded": s.n_decoded,
                    }
                ],
                "prompt": task.prompt_text or detokenize(task.prompt),
                "generated": s.text,
            }
        )
    return res


_METRICS = [  # name, help, type
    ("prompt_tokens_total", "Number of prompt tokens processed.", "counter"),
    ("prompt_seconds_total", "Prompt process time", "counter"),
    ("tokens_predicted_total", "Number of generation tokens processed.", "counter"),
    ("tokens_predicted_seconds_total", "Predict process time", "counter"),
    ("n_decode_total", "Total number of llama_decode() calls", "counter"),
    ("n_tokens_max", "Largest observed n_tokens.", "counter"),
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", "gauge"),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", "gauge"),
    ("requests_processing", "Number of requests processing.", "gauge"),
    ("requests_deferred", "Number of requests deferred.", "gauge"),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", "gauge"),
]


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else str(round(v, 6))


def metrics_text(sch: Scheduler) -> str:
    """Prometheus text with llama.cpp's `llamacpp:` metrics, then this project's `ubatch:` ones
    (how many sequences and rows each decode carried)."""
    st = sch.stats
    vals = [
        st.n_prompt_tokens_total,
        st.t_prompt_ms_total / 1e3,
        st.n_predicted_total,
        st.t_predicted_ms_total / 1e3,
        st.n_decode_total,
        st.n_tokens_max,
        tokens_per_second(st.n_prompt_tokens, st.t_prompt_ms),
        tokens_per_second(st.n_predicted, st.t_predicted_ms),
        sum(s.busy for s in sch.slots),
        sch.n_deferred,
        st.n_busy_slots_total / max(st.n_decode_total, 1),
    ]
    st.reset_bucket()
    lines = []
    for (name, help, kind), v in zip(_METRICS, vals):
        lines += [f"# HELP llamacpp:{name} {help}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {_num(v)}"]

    def emit(name: str, help: str, kind: str, v: float | list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP ubatch:{name} {help}", f"# TYPE ubatch:{name} {kind}"])
        for label, x in v if isinstance(v, list) else [("", v)]:
            lines.append(f"ubatch:{name}{label} {_num(x)}")

    emit("iterations_total", "Scheduler iterations.", "counter", sch.iteration)
    emit("decode_rows_total", "Token rows submitted to decode calls.", "counter", st.n_rows_total)
    emit("ubatches_total", "Ubatches (forward passes) run by decode calls.", "counter", st.n_ubatch_total)
    emit(
        "decode_seqs_max",
        "Most sequences carried by a single decode call.",
        "gauge",
        max(st.decodes_by_n_seqs, default=0),
    )
    emit(
        "decodes_by_n_seqs_total",
        "Decode calls by the number of sequences they carried.",
        "counter",
        [(f'{{n_seqs="{k}"}}', v) for k, v in sorted(st.decodes_by_n_seqs.items())],
    )
    emit("requests_total", "Completion tasks accepted.", "counter", st.n_requests)
    emit("requests_cancelled_total", "Tasks cancelled because the client disconnected.", "counter", st.n_cancelled)
    emit("kv_cells_used", "KV cache cells in use.", "gauge", sch.ctx.memory.used)
    return "\n".join(lines) + "\n"
