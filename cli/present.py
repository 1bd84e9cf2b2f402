"""Text llama.cpp users know: startup lines and the end-of-run performance summary."""

from __future__ import annotations

from ..engine.context import Context
from ..engine.generate import CompletionStats

MiB = 1024 * 1024


def startup_lines(ctx: Context) -> list[str]:
    m, cp, hp = ctx.model, ctx.cparams, ctx.model.hparams
    lines = [
        f"llama_model_loader: loaded {m.path.name}: {m.name} ({hp.arch}), "
        f"{m.n_params / 1e6:.2f} M params, {m.size_bytes / MiB:.2f} MiB, "
        f"{8 * m.size_bytes / m.n_params:.2f} BPW",
        f"print_info: n_ctx_train = {hp.n_ctx_train}, n_embd = {hp.n_embd}, n_layer = {hp.n_layer}, "
        f"n_head = {hp.n_head}, n_head_kv = {hp.n_head_kv}, n_swa = {hp.n_swa}, n_vocab = {hp.n_vocab}",
        f"llama_context: n_seq_max     = {cp.n_seq_max}",
        f"llama_context: n_ctx         = {cp.n_ctx}",
        f"llama_context: n_ctx_seq     = {cp.n_ctx_seq}",
        f"llama_context: n_batch       = {cp.n_batch}",
        f"llama_context: n_ubatch      = {cp.n_ubatch}",
        f"llama_context: causal_attn   = {int(cp.causal_attn)}",
        f"llama_context: kv_unified    = {str(cp.kv_unified).lower()}",
        f"llama_context: n_threads     = {cp.n_threads}",
    ]
    lines += [f"llama_context: WARNING: {w}" for w in cp.warnings]
    if cp.n_ctx_seq < hp.n_ctx_train:
        lines.append(f"llama_context: n_ctx_seq ({cp.n_ctx_seq}) < n_ctx_train ({hp.n_ctx_train}) -- "
                     "the full capacity of the model will not be utilized")
    for c in ctx.memory.caches:
        i = c.info()
        if i.name:
            lines.append(f"llama_kv_cache_iswa: creating {i.name:>7} KV cache, size = {i.size} cells")
        lines.append(
            f"llama_kv_cache: size = {(i.k_bytes + i.v_bytes) / MiB:7.2f} MiB ({i.size:6d} cells, "
            f"{i.n_layer:3d} layers, {i.n_seq_max:2d}/{i.n_seq_max} seqs), K ({i.type_k}): "
            f"{i.k_bytes / MiB:7.2f} MiB, V ({i.type_v}): {i.v_bytes / MiB:7.2f} MiB")
    return lines


def perf_lines(ctx: Context, st: CompletionStats, load_ms: float, total_ms: float) -> list[str]:
    p = "common_perf_print:"
    n_p, n_e = max(st.n_prompt, 1), max(st.n_eval, 1)
    unacc = total_ms - st.t_sample_ms - st.t_prompt_ms - st.t_eval_ms
    return [
        f"{p}    sampling time = {st.t_sample_ms:10.2f} ms",
        f"{p}        load time = {load_ms:10.2f} ms",
        f"{p} prompt eval time = {st.t_prompt_ms:10.2f} ms / {n_p:5d} tokens "
        f"({st.t_prompt_ms / n_p:8.2f} ms per token, {1e3 * n_p / max(st.t_prompt_ms, 1e-9):8.2f} tokens per second)",
        f"{p}        eval time = {st.t_eval_ms:10.2f} ms / {n_e:5d} runs   "
        f"({st.t_eval_ms / n_e:8.2f} ms per token, {1e3 * n_e / max(st.t_eval_ms, 1e-9):8.2f} tokens per second)",
        f"{p}       total time = {total_ms:10.2f} ms / {st.n_prompt + st.n_gen:5d} tokens",
        f"{p} unaccounted time = {unacc:10.2f} ms / {100 * unacc / max(total_ms, 1e-9):5.1f} %",
        f"{p}    graphs reused = {ctx.perf.graphs_reused:10d}",
    ]
