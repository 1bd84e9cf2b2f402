"""How `ubatch batched-bench` prints: llama-batched-bench's header line, table and jsonl rows.

They are copied format string for format string so scripts that parse llama.cpp's
batched-bench output read ubatch's unchanged; the jsonl rows then add ubatch's buffer and KV
sizes. llama-bench's formats are a different tool's and live in cli/bench_format.py.
"""

from __future__ import annotations

import json

from ubatch.cli.bench.batched import BatchedHeader, BatchedResult


def batched_header_line(h: BatchedHeader) -> str:
    return (
        f"llama_batched_bench: n_kv_max = {h.n_kv_max}, n_batch = {h.n_batch}, n_ubatch = {h.n_ubatch}, "
        f"flash_attn = {h.flash_attn}, is_pp_shared = {h.is_pp_shared}, is_tg_separate = "
        f"{h.is_tg_separate}, n_gpu_layers = {h.n_gpu_layers}, n_threads = {h.n_threads}, "
        f"n_threads_batch = {h.n_threads_batch}"
    )


def batched_md_head() -> str:
    return "|%6s | %6s | %4s | %6s | %8s | %8s | %8s | %8s | %8s | %8s |\n" % (
        "PP",
        "TG",
        "B",
        "N_KV",
        "T_PP s",
        "S_PP t/s",
        "T_TG s",
        "S_TG t/s",
        "T s",
        "S t/s",
    ) + "|%6s-|-%6s-|-%4s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|\n" % (
        "------",
        "------",
        "----",
        "------",
        "--------",
        "--------",
        "--------",
        "--------",
        "--------",
        "--------",
    )


def batched_md_row(r: BatchedResult) -> str:
    return "|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |\n" % (
        r.pp,
        r.tg,
        r.pl,
        r.n_kv,
        r.t_pp,
        r.speed_pp,
        r.t_tg,
        r.speed_tg,
        r.t,
        r.speed,
    )


def batched_jsonl_row(h: BatchedHeader, r: BatchedResult) -> str:
    d = {
        "n_kv_max": h.n_kv_max,
        "n_batch": h.n_batch,
        "n_ubatch": h.n_ubatch,
        "flash_attn": h.flash_attn,
        "is_pp_shared": h.is_pp_shared,
        "n_gpu_layers": h.n_gpu_layers,
        "n_threads": h.n_threads,
        "n_threads_batch": h.n_threads_batch,
        "pp": r.pp,
        "tg": r.tg,
        "pl": r.pl,
        "n_kv": r.n_kv,
        "t_pp": r.t_pp,
        "speed_pp": r.speed_pp,
        "t_tg": r.t_tg,
        "speed_tg": r.speed_tg,
        "t": r.t,
        "speed": r.speed,
        "compute_buffer_mib": h.compute_buffer_mib,
        "kv_mib": h.kv_mib,
    }
    return json.dumps(d) + "\n"
