"""llama-server's monitoring bodies: one /slots entry per slot and the Prometheus /metrics text.

These read a snapshot of the engine (engine/serve/snapshot.py) rather than one request's events, and
/metrics is where ubatch adds its batching counters (sequences and rows per decode), so they
are apart from the completion bodies in cli/server/responses.py.
"""

from __future__ import annotations

import os
from typing import Any

from ubatch.cli.server.responses import params_json
from ubatch.engine.serve.snapshot import SlotView, Snapshot
from ubatch.engine.serve.stats import TokenTotals
from ubatch.engine.units import tokens_per_second

SLOTS_DEBUG = os.environ.get("LLAMA_SERVER_SLOTS_DEBUG", "") not in ("", "0")


def slot_json(s: SlotView, detokenize: Any) -> dict[str, Any]:
    """One /slots entry with llama-server's keys (plus `n_cache_tokens`, the cells the slot
    holds); the prompt and generated text only with LLAMA_SERVER_SLOTS_DEBUG set, as there."""
    task = s.task
    res: dict[str, Any] = {
        "id": s.id,
        "n_ctx": s.n_ctx,
        "speculative": s.speculative,
        "is_processing": s.busy,
        "n_cache_tokens": s.n_cache,
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
                # ubatch's: where those cached tokens came from (issue: shared prefixes)
                "n_prompt_tokens_cache_own": s.reuse.n_own,
                "n_prompt_tokens_cache_shared": s.reuse.n_shared,
                "n_prompt_tokens_cache_ram": s.reuse.n_ram,
                "prompt_cache_source_slot": s.reuse.source,
                "params": params_json(p),
                "next_token": [
                    {
                        "has_next_token": s.busy,
                        "has_new_line": s.has_new_line,
                        "n_remain": n_remain,
                        "n_decoded": s.n_decoded,
                    }
                ],
            }
        )
        if SLOTS_DEBUG:
            res["prompt"] = task.prompt_text or detokenize(task.prompt)
            res["generated"] = s.text
    return res


_COUNTERS = [  # llama-server's names and help texts, counters first, then gauges
    ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "Total time spent processing prompts"),
    ("tokens_predicted_total", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "Total time spent generating tokens"),
    ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding"),
    ("n_tokens_max", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps"),
]
_GAUGES = [
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s"),
    ("requests_processing", "Number of requests processing"),
    ("requests_deferred", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call"),
]


def _num(v: float) -> str:
    """A value as C++'s ostream writes a double (6 significant digits, %g): what llama-server sends."""
    return f"{float(v):g}"


def metrics_text(snap: Snapshot, since: TokenTotals) -> str:
    """Prometheus text with llama.cpp's `llamacpp:` metrics, then this project's `ubatch:` ones
    (how many sequences and rows each decode carried). The throughput gauges are averaged over
    the window since the last read, whose totals were `since`."""
    st, spec = snap.stats, snap.spec
    t = st.total
    counters = [
        st.total.n_prompt_tokens,
        st.n_prompt_cached_total,
        st.total.t_prompt_ms / 1e3,
        st.total.n_predicted,
        st.total.t_predicted_ms / 1e3,
        st.n_decode_total,
        st.n_tokens_max,
        spec.n_drafted,
        spec.n_accepted,
        spec.n_drafts,
    ]
    gauges = [
        tokens_per_second(t.n_prompt_tokens - since.n_prompt_tokens, t.t_prompt_ms - since.t_prompt_ms),
        tokens_per_second(t.n_predicted - since.n_predicted, t.t_predicted_ms - since.t_predicted_ms),
        sum(s.busy for s in snap.slots),
        snap.n_deferred,
        st.n_busy_slots_total / max(st.n_decode_total, 1),
    ]
    lines = []
    for kind, items, vals in (("counter", _COUNTERS, counters), ("gauge", _GAUGES, gauges)):
        for (name, help), v in zip(items, vals):
            lines += [f"# HELP llamacpp:{name} {help}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {_num(v)}"]
    if spec.accepted_per_pos:  # llama-server's labelled counter, one series per draft position
        name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
        lines += [f"# HELP {name} Accepted tokens per draft position", f"# TYPE {name} counter"]
        lines += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(spec.accepted_per_pos)]

    def emit(name: str, help: str, kind: str, v: float | list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP ubatch:{name} {help}", f"# TYPE ubatch:{name} {kind}"])
        for label, x in v if isinstance(v, list) else [("", v)]:
            lines.append(f"ubatch:{name}{label} {_num(x)}")

    emit("iterations_total", "Scheduler iterations.", "counter", snap.iteration)
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
    emit("kv_cells_used", "KV cache cells in use.", "gauge", snap.kv_used)

    def by_source(own: int, shared: int, ram: int) -> list[tuple[str, float]]:
        return [('{source="own"}', own), ('{source="shared"}', shared), ('{source="ram"}', ram)]

    reused = by_source(st.n_reused_own_total, st.n_reused_shared_total, st.n_reused_ram_total)
    emit("prompt_tokens_reused_total", "Prompt tokens reused, by where they were found.", "counter", reused)
    hits = by_source(st.n_hits_own, st.n_hits_shared, st.n_hits_ram)
    emit("prompt_cache_hits_total", "Requests that reused a prefix, by where it was found.", "counter", hits)
    emit("kv_cells_shared", "KV cells held by more than one sequence.", "gauge", snap.n_cells_shared)
    emit("host_cache_bytes", "Prompt states kept in host memory (--cache-ram).", "gauge", snap.host_bytes)
    emit("host_cache_entries", "Prompt states kept in host memory.", "gauge", snap.host_entries)
    emit("kv_evictions_total", "Idle sequences' cells given up under KV pressure.", "counter", st.n_evictions)
    emit(
        "prefix_waits_total",
        "Launches held back for a prefix another slot was computing.",
        "counter",
        st.n_waited_prefix,
    )
    return "\n".join(lines) + "\n"
