"""Text llama.cpp users know (startup lines, the performance summary) and the Rich views of
the same reports."""

from __future__ import annotations

from rich.table import Table

from ..engine.context import Context
from ..engine.generate import CompletionStats
from ..engine.units import tokens_per_second
from ..engine.report import MemoryPlan, memory_plan

MiB = 1024 * 1024


def mib(n: int) -> float:
    return n / MiB


def startup_lines(ctx: Context, plan: MemoryPlan | None = None) -> list[str]:
    """llama.cpp's startup log, then what llama.cpp does not say: why the buffer is this size."""
    m, cp, hp = ctx.model, ctx.cparams, ctx.model.hparams
    p = plan or memory_plan(ctx)
    L = [
        f"llama_model_loader: loaded {m.path.name}: {m.name} ({hp.arch}), {p.n_params / 1e6:.2f} M params, "
        f"{mib(p.model_bytes):.2f} MiB, {8 * p.model_bytes / p.n_params:.2f} BPW",
        f"print_info: n_ctx_train = {hp.n_ctx_train}, n_embd = {hp.n_embd}, n_layer = {hp.n_layer}, "
        f"n_head = {hp.n_head}, n_head_kv = {hp.n_head_kv}, n_swa = {hp.n_swa}, n_vocab = {hp.n_vocab}",
        "llama_context: constructing llama_context",
        f"llama_context: n_seq_max             = {cp.n_seq_max}",
        f"llama_context: n_ctx                 = {cp.n_ctx}",
        f"llama_context: n_ctx_seq             = {cp.n_ctx_seq}",
        f"llama_context: n_batch               = {cp.n_batch}",
        f"llama_context: n_ubatch              = {cp.n_ubatch}",
        f"llama_context: causal_attn           = {int(cp.causal_attn)}",
        "llama_context: flash_attn            = auto",
        f"llama_context: kv_unified            = {str(cp.kv_unified).lower()}",
        f"llama_context: freq_base             = {hp.rope_freq_base:.1f}",
        f"llama_context: freq_scale            = {hp.rope_freq_scale:g}",
        f"llama_context: n_outputs_max         = {cp.n_outputs_max}",
        f"llama_context: n_threads             = {cp.n_threads}",
    ]
    L += [f"llama_context: WARNING: {w}" for w in p.warnings]
    L.append(f"ubatch: backend = {p.backend}, weights held beyond the file = {mib(p.backend_bytes):.2f} MiB")
    L += [f"ubatch:   {t:<6} {path}" for t, path in p.kernels.items()]
    if cp.n_ctx_seq < hp.n_ctx_train:
        L.append(f"llama_context: n_ctx_seq ({cp.n_ctx_seq}) < n_ctx_train ({hp.n_ctx_train}) -- "
                 "the full capacity of the model will not be utilized")
    L.append(f"llama_context: {'CPU':>10}  output buffer size = {mib(p.output_bytes):8.2f} MiB")
    for i in p.kv:
        if i.name:
            L.append(f"llama_kv_cache_iswa: creating {i.name:>7} KV cache, size = {i.size} cells")
        L.append(f"llama_kv_cache: {'CPU':>10} KV buffer size = {mib(i.k_bytes + i.v_bytes):8.2f} MiB")
        L.append(f"llama_kv_cache: size = {mib(i.k_bytes + i.v_bytes):7.2f} MiB ({i.size:6d} cells, "
                 f"{i.n_layer:3d} layers, {i.n_seq_max:2d}/{i.n_stream} seqs), K ({i.type_k}): "
                 f"{mib(i.k_bytes):7.2f} MiB, V ({i.type_v}): {mib(i.v_bytes):7.2f} MiB")
    n, s, o = p.worst_case
    L += [
        f"llama_context: worst-case: n_tokens = {n}, n_seqs = {s}, n_outputs = {o}",
        f"sched_reserve: {'CPU':>10} compute buffer size = {mib(p.compute_bytes):8.2f} MiB",
        f"sched_reserve: graph (pp bs={n}, tg bs={s}): nodes = {p.graph_nodes[0]} / {p.graph_nodes[1]}, "
        f"workspace = {mib(p.pp_bytes):.2f} / {mib(p.tg_bytes):.2f} MiB",
        f"ubatch: the compute buffer peaks with these tensors alive (n_outputs_max = {p.n_outputs_max}):",
    ]
    for name, shape, b in p.peak[:6]:
        L.append(f"ubatch:   {name:<22} {str(list(shape)):<22} {mib(b):8.2f} MiB")
    return L


def breakdown_table(p: MemoryPlan) -> Table:
    """llama.cpp's memory breakdown (model / context / compute), plus what the backend holds."""
    t = Table(title="memory breakdown (MiB)", title_justify="left")
    for col in ("device", "total", "model", f"{p.backend} backend", "context (KV + out)", "compute"):
        t.add_column(col, justify="right" if col != "device" else "left")
    t.add_row("CPU", f"{mib(p.total_bytes):.2f}", f"{mib(p.model_bytes):.2f}", f"{mib(p.backend_bytes):.2f}",
              f"{mib(p.context_bytes):.2f}", f"{mib(p.compute_bytes):.2f}")
    return t


def plan_table(p: MemoryPlan) -> Table:
    t = Table(title=f"memory plan: {p.model_file}", title_justify="left")
    t.add_column("what")
    t.add_column("size", justify="right")
    t.add_column("why")
    t.add_row("model (GGUF, mmap)", f"{mib(p.model_bytes):.2f} MiB", f"{p.n_params / 1e6:.1f} M params as stored")
    t.add_row(f"{p.backend} backend weights", f"{mib(p.backend_bytes):.2f} MiB",
              "dense f32 copies (torch reference)" if p.backend_bytes else "none: kernels read the GGUF blocks")
    for tname, path in p.kernels.items():
        t.add_row(f"  {tname} matrices", "", path)
    for c in p.kv:
        t.add_row(f"KV cache {c.name or ''}".strip(), f"{mib(c.k_bytes + c.v_bytes):.2f} MiB",
                  f"{c.size} cells x {c.n_stream} stream(s) x {c.n_layer} layers, K {c.type_k} / V {c.type_v}")
    t.add_row("output buffer", f"{mib(p.output_bytes):.2f} MiB", f"logits rows for {p.n_seq_max} sequence(s)")
    n, s, o = p.worst_case
    t.add_row("compute buffer", f"{mib(p.compute_bytes):.2f} MiB",
              f"prompt ubatch of {n} tokens x {s} seqs, {min(n, p.n_outputs_max)} output rows, full KV")
    for name, shape, b in p.peak[:6]:
        t.add_row(f"  {name}", f"{mib(b):.2f} MiB", f"{list(shape)} alive at the peak")
    t.add_row("total", f"{mib(p.total_bytes):.2f} MiB", "")
    return t


def perf_lines(ctx: Context, st: CompletionStats, load_ms: float, total_ms: float) -> list[str]:
    p = "common_perf_print:"
    n_p, n_e = max(st.n_prompt, 1), max(st.n_eval, 1)
    unacc = total_ms - st.t_sample_ms - st.t_prompt_ms - st.t_eval_ms
    tps = tokens_per_second
    return [
        f"{p}    sampling time = {st.t_sample_ms:10.2f} ms",
        f"{p}        load time = {load_ms:10.2f} ms",
        f"{p} prompt eval time = {st.t_prompt_ms:10.2f} ms / {n_p:5d} tokens "
        f"({st.t_prompt_ms / n_p:8.2f} ms per token, {tps(n_p, st.t_prompt_ms):8.2f} tokens per second)",
        f"{p}        eval time = {st.t_eval_ms:10.2f} ms / {n_e:5d} runs   "
        f"({st.t_eval_ms / n_e:8.2f} ms per token, {tps(n_e, st.t_eval_ms):8.2f} tokens per second)",
        f"{p}       total time = {total_ms:10.2f} ms / {st.n_prompt + st.n_gen:5d} tokens",
        f"{p} unaccounted time = {unacc:10.2f} ms / {100 * unacc / max(total_ms, 1e-9):5.1f} %",
        f"{p}    graphs reused = {ctx.perf.graphs_reused:10d}",
    ]
