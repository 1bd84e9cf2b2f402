"""The one renderer of a MemoryPlan: llama.cpp's startup lines, Rich tables, chat rows and JSON.

Every command that reports memory (cli, info, chat, server) goes through here, so a KV cache or
a compute buffer is worded, rounded and summed the same way wherever it is shown.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from ubatch.cli.device import device_name
from ubatch.engine.context.report import MemoryPlan
from ubatch.engine.units import mib

Rows = list[tuple[str, str]]  # (label, text): the chat's panel and /stats


def size(n: int) -> str:
    """Bytes as llama.cpp writes a buffer size: MiB with two decimals."""
    return f"{mib(n):.2f} MiB"


# -- llama.cpp's startup lines --------------------------------------------------------------------


def llama_lines(p: MemoryPlan) -> list[str]:
    """What llama.cpp logs after the context parameters (buffers, KV caches, compute buffer), then
    what it does not say: the backend's weights and why the compute buffer is this size."""
    L = [f"llama_context: WARNING: {w}" for w in p.warnings]
    L += tp_lines(p)
    L.append(f"ubatch: backend = {p.backend}, weights held beyond the file = {mib(p.backend_bytes):.2f} MiB")
    L += lora_lines(p)
    L += [f"ubatch:   kernels: {line}" for line in p.dispatch]
    L += [f"ubatch:   {t:<6} {path}" for t, path in p.kernels.items()]
    if p.n_ctx_seq < p.n_ctx_train:
        L.append(
            f"llama_context: n_ctx_seq ({p.n_ctx_seq}) < n_ctx_train ({p.n_ctx_train}) -- the full capacity of the model will not be utilized"
        )
    dev = device_name(p.device)  # the KV cache and the compute buffer; the logits rows stay on the host
    L.append(f"llama_context: {'CPU':>10}  output buffer size = {mib(p.output_bytes):8.2f} MiB")
    for i in p.kv:
        if i.name:
            L.append(f"llama_kv_cache_iswa: creating {i.name:>7} KV cache, size = {i.size} cells")
        L.append(f"llama_kv_cache: {dev:>10} KV buffer size = {mib(i.k_bytes + i.v_bytes):8.2f} MiB")
        L.append(
            f"llama_kv_cache: size = {mib(i.k_bytes + i.v_bytes):7.2f} MiB ({i.size:6d} cells, "
            f"{i.n_layer:3d} layers, {i.n_seq_max:2d}/{i.n_stream} seqs), K ({i.type_k}): "
            f"{mib(i.k_bytes):7.2f} MiB, V ({i.type_v}): {mib(i.v_bytes):7.2f} MiB"
        )
    L += mla_lines(p)
    n, s, o = p.worst_case
    L += [
        f"llama_context: worst-case: n_tokens = {n}, n_seqs = {s}, n_outputs = {o}",
        f"sched_reserve: {dev:>10} compute buffer size = {mib(p.compute_bytes):8.2f} MiB",
        f"sched_reserve: graph (pp bs={n}, tg bs={s}): nodes = {p.graph_nodes[0]} / {p.graph_nodes[1]}, "
        f"workspace = {mib(p.pp_bytes):.2f} / {mib(p.tg_bytes):.2f} MiB",
        f"ubatch: the compute buffer peaks with these tensors alive (n_outputs_max = {p.n_outputs_max}):",
    ]
    for name, shape, b in p.peak[:6]:
        L.append(f"ubatch:   {name:<22} {list(shape)!s:<22} {mib(b):8.2f} MiB")
    return L + moe_lines(p)


def lora_lines(p: MemoryPlan) -> list[str]:
    """Each LoRA adapter: llama.cpp's buffer line, then what it targets."""
    dev = device_name(p.device)
    L = []
    for a in p.loras:
        ranks = "/".join(str(r) for r in a.ranks)
        L.append(f"llama_adapter_lora_init_impl: {dev:>10} LoRA buffer size = {mib(a.nbytes):8.2f} MiB")
        L.append(f"ubatch: LoRA adapter {a.id}: {a.path}, {a.n_pairs} matrices, rank {ranks}, alpha {a.alpha:g}")
    return L


def mla_why(p: MemoryPlan) -> str:
    """Latent attention's cache in a few words: the compressed row against per-head K and V."""
    a = p.mla
    if a is None:
        return ""
    return (
        f"latent attention (MLA): K only, {a.kv_lora_rank} latent + {a.n_rot} RoPE = {a.cell_values} values "
        f"per cell and layer (per-head K and V: {a.n_head} x ({a.n_embd_head_k} + {a.n_embd_head_v}) = "
        f"{a.mha_values}, {a.mha_values / a.cell_values:.1f}x)"
    )


def mla_lines(p: MemoryPlan) -> list[str]:
    return [f"llama_kv_cache: {mla_why(p)}"] if p.mla is not None else []


def moe_lines(p: MemoryPlan) -> list[str]:
    """A mixture of experts: the weights a token reads against those the file holds, and the
    router's and experts' tensors of one layer in the compute buffer."""
    e = p.moe
    if e is None:
        return []
    L = [
        f"ubatch: experts = {e.n_expert}, used per token = {e.n_expert_used}, expert FFN = {e.n_ff_exp}; "
        f"weights {mib(p.model_bytes):.2f} MiB total, {mib(e.active_bytes):.2f} MiB active per token "
        f"({e.active_params / 1e6:.1f} of {p.n_params / 1e6:.1f} M params; experts {mib(e.expert_bytes):.2f} MiB)",
        "ubatch: the router's and the experts' tensors of each layer in the compute buffer:",
    ]
    L += [f"ubatch:   {name:<24} {list(shape)!s:<22} {mib(b):8.2f} MiB" for name, shape, b in e.compute]
    return L


def tp_lines(p: MemoryPlan) -> list[str]:
    """Tensor parallelism: how the model is cut, that the plan is one rank's, what the ranks exchange."""
    t = p.tp
    if t is None:
        return []
    kv = " (replicated: fewer KV heads than ranks)" if t.kv_replicated else ""
    return [
        f"ubatch: tensor parallel = {t.world} ranks; the sizes below are one rank's (weights "
        f"{mib(p.model_bytes):.2f} of {mib(t.whole_bytes):.2f} MiB)",
        f"ubatch:   per rank: n_head {t.n_head[0]} -> {t.n_head[1]}, n_head_kv {t.n_head_kv[0]} -> "
        f"{t.n_head_kv[1]}{kv}, n_ff {t.n_ff[0]} -> {t.n_ff[1]}, n_vocab {t.n_vocab[0]} -> {t.n_vocab[1]}",
        f"ubatch:   all-reduce: {t.all_reduces} per forward pass, {t.all_reduce_bytes / 1024:.1f} KiB per token, "
        f"in place on the compute buffer; logits gather buffer (rank 0) = {mib(t.gather_bytes):.2f} MiB",
    ]


# -- Rich tables ----------------------------------------------------------------------------------

PIPED_WIDTH = 1000  # columns of a table console whose stdout is a file or a pipe: in effect no limit


def table_console() -> Console:
    """The console that prints tables on stdout (explain, info). On a terminal Rich fits them to
    the window. A file or a pipe has no window: Rich would fall back to 80 columns (or to the
    width of the terminal that stderr is still on), wrap every row and cut headers to `sequ…`,
    so there a table keeps its natural width and a paragraph its one line. COLUMNS, when set,
    wins either way; --json remains the format for programs."""
    if os.environ.get("COLUMNS", "").strip().isdigit() or sys.stdout.isatty():
        return Console(highlight=False)
    return Console(highlight=False, width=PIPED_WIDTH)


def breakdown_table(p: MemoryPlan) -> Table:
    """llama.cpp's memory breakdown (model / context / compute), plus what the backend holds."""
    t = Table(title="memory breakdown (MiB)", title_justify="left")
    for col in ("device", "total", "model", f"{p.backend} backend", "context (KV + out)", "compute"):
        t.add_column(col, justify="right" if col != "device" else "left")
    t.add_row(
        device_name(p.device),
        f"{mib(p.total_bytes):.2f}",
        f"{mib(p.model_bytes + p.lora_bytes):.2f}",  # llama.cpp counts adapters with the model
        f"{mib(p.backend_bytes):.2f}",
        f"{mib(p.context_bytes):.2f}",
        f"{mib(p.compute_bytes):.2f}",
    )
    return t


def _held_why(p: MemoryPlan) -> str:
    if not p.backend_bytes:
        return "none: kernels read the GGUF blocks"
    if p.backend == "torch":
        return "dense f32 copies (torch reference)"
    return "repacked matrices (below), net of the file pages they release"


def plan_table(p: MemoryPlan) -> Table:
    """Every buffer of the plan with its size and the reason for that size."""
    title = f"memory plan: {p.model_file}"
    if p.tp is not None:
        title += f" (one of {p.tp.world} tensor-parallel ranks)"
    t = Table(title=title, title_justify="left")
    t.add_column("what")
    t.add_column("size", justify="right")
    t.add_column("why")
    if p.tp is None:
        t.add_row("model (GGUF, mmap)", size(p.model_bytes), f"{p.n_params / 1e6:.1f} M params as stored")
    else:
        tp = p.tp
        t.add_row(
            "model (this rank's cut)",
            size(p.model_bytes),
            f"{p.n_params / 1e6:.1f} M params: heads {tp.n_head[1]}/{tp.n_head[0]}, KV heads {tp.n_head_kv[1]}/"
            f"{tp.n_head_kv[0]}, FFN {tp.n_ff[1]}/{tp.n_ff[0]}, vocabulary {tp.n_vocab[1]}/{tp.n_vocab[0]} "
            f"(whole model {size(tp.whole_bytes)})",
        )
    if p.moe is not None:
        e = p.moe
        t.add_row(
            "  active per token",
            size(e.active_bytes),
            f"{e.active_params / 1e6:.1f} M params: {e.n_expert_used} of {e.n_expert} experts "
            f"({size(e.expert_bytes)} of experts in all) and every other tensor",
        )
    for a in p.loras:
        t.add_row(
            f"LoRA adapter {a.id}",
            size(a.nbytes),
            f"{a.name}: {a.n_pairs} A/B pairs as stored, rank {'/'.join(map(str, a.ranks))}, alpha {a.alpha:g}",
        )
    t.add_row(f"{p.backend} backend weights", size(p.backend_bytes), _held_why(p))
    for label, line in zip(("  kernel builds", "  build probe"), p.dispatch, strict=False):
        t.add_row(label, "", line)
    for tname, path in p.kernels.items():
        t.add_row(f"  {tname} matrices", "", path)
    for c in p.kv:
        t.add_row(
            f"KV cache {c.name or ''}".strip(),
            size(c.k_bytes + c.v_bytes),
            f"{c.size} cells x {c.n_stream} stream(s) x {c.n_layer} layers, K {c.type_k} / V {c.type_v}"
            + (f"; {mla_why(p)}" if p.mla is not None else ""),
        )
    t.add_row("output buffer", size(p.output_bytes), f"logits rows for {p.n_seq_max} sequence(s)")
    n, s, _ = p.worst_case
    t.add_row(
        "compute buffer",
        size(p.compute_bytes),
        f"prompt ubatch of {n} tokens x {s} seqs, {min(n, p.n_outputs_max)} output rows, full KV",
    )
    for name, shape, b in p.peak[:6]:
        t.add_row(f"  {name}", size(b), f"{list(shape)} alive at the peak")
    for name, shape, b in p.moe.compute if p.moe is not None else []:
        t.add_row(f"  {name}", size(b), f"{list(shape)}: the router's or experts' (each layer)")
    if p.tp is not None:
        t.add_row(
            "logits gather (rank 0)",
            size(p.tp.gather_bytes),
            f"{p.tp.world} ranks' vocabulary slices x {p.n_outputs_max} output rows; all-reduces run in place",
        )
    t.add_row("total", size(p.total_bytes), "")
    return t


# -- compact rows (the chat's startup panel and /stats) -------------------------------------------


def model_size(p: MemoryPlan) -> str:
    return f"{p.n_params / 1e6:.2f} M params · {size(p.model_bytes)} ({p.bits_per_weight:.2f} BPW)"


def kv_row(p: MemoryPlan) -> tuple[str, str]:
    kv = [
        f"{(c.name + ' ') if c.name else ''}{c.size} cells × {c.n_layer} layers = {size(c.k_bytes + c.v_bytes)}"
        for c in p.kv
    ]
    types = [f"K {p.kv[0].type_k} / V {p.kv[0].type_v}"] if p.kv else []
    return "KV cache", " · ".join(kv + types)


def compute_row(p: MemoryPlan) -> tuple[str, str]:
    n = p.worst_case[0]
    peak = f"; largest: {p.peak[0][0]} {list(p.peak[0][1])} {size(p.peak[0][2])}" if p.peak else ""
    return "compute", f"{size(p.compute_bytes)} for a {n}-token ubatch over the full KV (shrinks with -ub){peak}"


def total_row(p: MemoryPlan) -> tuple[str, str]:
    return "memory", (
        f"{size(p.total_bytes)} = model {mib(p.model_bytes):.2f} + {p.backend} backend "
        f"{mib(p.backend_bytes):.2f} + KV {mib(p.kv_bytes):.2f} + output "
        f"{mib(p.output_bytes):.2f} + compute {mib(p.compute_bytes):.2f}"
    )


def summary_rows(p: MemoryPlan) -> Rows:
    """The plan in three rows: the KV caches, the compute buffer, the total and its parts."""
    return [kv_row(p), compute_row(p), total_row(p)]


# -- JSON -----------------------------------------------------------------------------------------


def plan_json(p: MemoryPlan) -> dict[str, Any]:
    """The plan as JSON-ready data: every field, the peak tensors as objects, and the sums."""
    d = asdict(p)
    d["peak"] = [{"name": n, "shape": list(s), "bytes": b} for n, s, b in p.peak]
    if p.moe is not None:
        d["moe"]["compute"] = [{"name": n, "shape": list(s), "bytes": b} for n, s, b in p.moe.compute]
    if p.mla is not None:
        d["mla"].update(cell_values=p.mla.cell_values, mha_values=p.mla.mha_values)
    d.update(kv_bytes=p.kv_bytes, context_bytes=p.context_bytes, total_bytes=p.total_bytes)
    return d
