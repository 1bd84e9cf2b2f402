"""Text llama.cpp users know: the startup log, the performance summary and the terminal colours of
llama-completion. The memory part of the log is cli.memory_view's, so it reads the same in every
command."""

from __future__ import annotations

from ubatch.cli.memory_view import llama_lines
from ubatch.engine.completion.complete import CompletionStats
from ubatch.engine.context.context import Context
from ubatch.engine.context.report import MemoryPlan, memory_plan, plan_for
from ubatch.engine.graph.cuda_graphs import counters
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams, derive
from ubatch.engine.units import mib, tokens_per_second
from ubatch.kernels.cuda.graphs import summary

# llama-completion's colours on a terminal (-co): the prompt yellow, what you type green
PROMPT_COLOUR, INPUT_COLOUR, RESET = "\x1b[33m", "\x1b[1;32m", "\x1b[0m"


def startup_lines(
    ctx: Context | None,
    plan: MemoryPlan | None = None,
    *,
    model: Model | None = None,
    params: ContextParams | None = None,
) -> list[str]:
    """llama.cpp's startup log: the model (and its vocabulary's warnings), the context parameters,
    then the MemoryPlan's lines.
    Without a context (`ubatch info` allocates none), `model` and `params` say the same."""
    if ctx is not None:
        m, cp, p = ctx.model, ctx.cparams, plan or memory_plan(ctx)
    else:
        assert model is not None and params is not None
        m, cp = model, derive(params, model.hparams)
        p = plan or plan_for(model, params)
    hp = m.hparams
    return [
        f"llama_model_loader: loaded {m.path.name}: {m.name} ({hp.arch}), {p.n_params / 1e6:.2f} M params, "
        f"{mib(p.model_bytes):.2f} MiB, {p.bits_per_weight:.2f} BPW",
        *vocab_lines(m.vocab.warnings),
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
        *llama_lines(p),
    ]


def vocab_lines(warnings: list[str]) -> list[str]:
    """The vocabulary's load warnings as llama.cpp's llama_vocab::load logs them, one line each."""
    return [f"load: {w}" for w in warnings]


def perf_lines(ctx: Context, st: CompletionStats, load_ms: float, total_ms: float) -> list[str]:
    """llama.cpp's common_perf_print block.

    The accounting is llama.cpp's: its perf counters are reset after the warm-up, so `total time`
    runs from the start of the prompt eval to the end of generation and does not contain the load
    time, which is reported on its own line. Hence `total_ms` is the generation's wall time and
    total = sampling + prompt eval + eval + unaccounted: the remainder is the loop's own overhead
    (writing the text out, detokenizing, Python), small next to the forward passes.
    """
    p = "common_perf_print:"
    n_p, n_e = max(st.n_prompt, 1), max(st.n_eval, 1)
    unacc = total_ms - st.t_sample_ms - st.t_prompt_ms - st.t_eval_ms
    tps = tokens_per_second
    # speculation decodes several tokens per call: then the count is tokens, and the calls beside it
    runs = f"tokens in {st.n_eval_calls} calls " if st.n_eval_calls != st.n_eval else "runs   "
    return [
        f"{p}    sampling time = {st.t_sample_ms:10.2f} ms",
        f"{p}        load time = {load_ms:10.2f} ms",
        f"{p} prompt eval time = {st.t_prompt_ms:10.2f} ms / {n_p:5d} tokens "
        f"({st.t_prompt_ms / n_p:8.2f} ms per token, {tps(n_p, st.t_prompt_ms):8.2f} tokens per second)",
        f"{p}        eval time = {st.t_eval_ms:10.2f} ms / {n_e:5d} {runs}"
        f"({st.t_eval_ms / n_e:8.2f} ms per token, {tps(n_e, st.t_eval_ms):8.2f} tokens per second)",
        f"{p}       total time = {total_ms:10.2f} ms / {st.n_prompt + st.n_gen:5d} tokens",
        f"{p} unaccounted time = {unacc:10.2f} ms / {100 * unacc / max(total_ms, 1e-9):5.1f} %      (total - sampling - prompt eval - eval) / (total)",
        f"{p}    graphs reused = {ctx.perf.graphs_reused:10d}",
        *cuda_graph_lines(ctx, p),
    ]


def cuda_graph_lines(ctx: Context, prefix: str) -> list[str]:
    """The cuda backend's CUDA-graph captures and replays (nothing for the CPU backends)."""
    if ctx.ops.name != "cuda":
        return []
    return [f"{prefix} {summary(counters(ctx.ops))}"]
