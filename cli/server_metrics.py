"""llama-server's monitoring bodies: one /slots entry per slot and the Prometheus /metrics text.

These read the scheduler's live state (slots, counters) rather than one request's events, and
/metrics is where ubatch adds its batching counters (sequences and rows per decode), so they
are apart from the completion bodies in cli/server_json.py.
"""

from __future__ import annotations

from typing import Any

from ..engine.scheduler import Scheduler, Slot
from ..engine.units import tokens_per_second


def slot_json(s: Slot, detokenize: Any) -> dict[str, Any]:
    """One /slots entry. It is read on the event loop while the engine thread runs the slot, so
    the task and generation are read once (a slot that starts a task meanwhile swaps them)."""
    task, gen = s.task or s.last_task, s.gen
    n_decoded = gen.n_decoded if gen is not None else 0
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
        n_remain = p.n_predict - n_decoded if p.n_predict >= 0 else -1
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
                        "has_new_line": bool(gen and gen.has_new_line),
                        "n_remain": n_remain,
                        "n_decoded": n_decoded,
                    }
                ],
                "prompt": task.prompt_text or detokenize(task.prompt),
                "generated": gen.text if gen is not None else "",
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
