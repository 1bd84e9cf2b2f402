"""`ubatch cli`: a conversation in the terminal (no -p, or -cnv / -sys / -st), or with -p (or -f)
a one-shot completion, streamed, with llama-completion's summary."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from . import validate
from .common import backend_option, check_text, err_console, process_escapes, read_text_file, resolve_model, user_errors

MODEL, CTX, BATCH, SAMPLING, OUTPUT = "Model", "Context", "Batching", "Sampling", "Output"
CHAT = "Conversation"


@user_errors
def cli(
    model: Optional[Path] = typer.Option(
        None, "-m", "--model", help="GGUF file (default: Gemma 3 270M Q4_K_M, bundled)", rich_help_panel=MODEL
    ),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="prompt text", rich_help_panel=MODEL),
    file: Optional[Path] = typer.Option(
        None, "-f", "--file", help="read the prompt from a file", rich_help_panel=MODEL
    ),
    n_predict: int = typer.Option(
        -1, "-n", "--n-predict", help="tokens to generate (-1 = until end of generation)", rich_help_panel=MODEL
    ),
    ctx_size: int = typer.Option(0, "-c", "--ctx-size", help="context size (0 = from the model)", rich_help_panel=CTX),
    ctk: str = typer.Option(
        "f16", "-ctk", "--cache-type-k", help="KV cache type for K (f32, f16, bf16, q8_0, q4_0)", rich_help_panel=CTX
    ),
    ctv: str = typer.Option(
        "f16", "-ctv", "--cache-type-v", help="KV cache type for V (f32, f16, bf16, q8_0, q4_0)", rich_help_panel=CTX
    ),
    swa_full: bool = typer.Option(False, "--swa-full", help="full-size SWA cache", rich_help_panel=CTX),
    parallel: int = typer.Option(
        1, "-np", "--parallel", help="number of sequences (KV streams unless -kvu)", rich_help_panel=CTX
    ),
    kv_unified: bool = typer.Option(
        False, "-kvu", "--kv-unified", help="one KV buffer shared by all sequences", rich_help_panel=CTX
    ),
    context_shift: bool = typer.Option(
        False,
        "--context-shift/--no-context-shift",
        help="when the context is full, drop half of the non-kept tokens and go on (chat: also drop the oldest messages)",
        rich_help_panel=CTX,
    ),
    keep: int = typer.Option(
        0,
        "--keep",
        help="tokens of the prompt kept by a context shift (-1 = all; chat: the first prompt)",
        rich_help_panel=CTX,
    ),
    n_outputs_max: int = typer.Option(
        1,
        "--n-outputs-max",
        help="output rows the compute buffer is reserved for (0 = n_batch, llama-completion's choice)",
        rich_help_panel=BATCH,
    ),
    batch_size: int = typer.Option(
        2048, "-b", "--batch-size", help="logical batch size (max tokens per decode)", rich_help_panel=BATCH
    ),
    ubatch_size: int = typer.Option(
        512, "-ub", "--ubatch-size", help="physical batch size (max tokens per forward pass)", rich_help_panel=BATCH
    ),
    threads: int = typer.Option(-1, "-t", "--threads", help="CPU threads (-1 = all)", rich_help_panel=BATCH),
    backend: str = backend_option(BATCH),
    temp: float = typer.Option(0.8, "--temp", help="temperature (0 = greedy)", rich_help_panel=SAMPLING),
    top_k: int = typer.Option(40, "--top-k", rich_help_panel=SAMPLING),
    top_p: float = typer.Option(0.95, "--top-p", rich_help_panel=SAMPLING),
    min_p: float = typer.Option(0.05, "--min-p", rich_help_panel=SAMPLING),
    seed: int = typer.Option(-1, "-s", "--seed", help="RNG seed (-1 = random)", rich_help_panel=SAMPLING),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", rich_help_panel=SAMPLING),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", rich_help_panel=SAMPLING),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="keep generating past end-of-generation tokens", rich_help_panel=SAMPLING
    ),
    no_escape: bool = typer.Option(
        False, "--no-escape", help="do not process \\n, \\t escapes in the prompt", rich_help_panel=OUTPUT
    ),
    no_display_prompt: bool = typer.Option(
        False, "--no-display-prompt", help="do not echo the prompt", rich_help_panel=OUTPUT
    ),
    log_disable: bool = typer.Option(False, "--log-disable", help="no startup log or summary", rich_help_panel=OUTPUT),
    no_warmup: bool = typer.Option(False, "--no-warmup", rich_help_panel=OUTPUT),
    conversation: Optional[bool] = typer.Option(
        None,
        "--conversation/--no-conversation",
        "-cnv/-no-cnv",
        help="chat (default without -p / -f) or one-shot completion (default with -p / -f)",
        show_default=False,
        rich_help_panel=CHAT,
    ),
    system_prompt: Optional[str] = typer.Option(
        None, "-sys", "--system-prompt", help="system prompt (starts a conversation)", rich_help_panel=CHAT
    ),
    single_turn: bool = typer.Option(
        False,
        "-st",
        "--single-turn",
        help="answer one message (-p, or the first one typed) and exit",
        rich_help_panel=CHAT,
    ),
    chat_template: Optional[str] = typer.Option(
        None,
        "--chat-template",
        metavar="NAME|FILE",
        help="gemma, chatml, llama3, or a Jinja template file (default: the GGUF's template, else by architecture)",
        rich_help_panel=CHAT,
    ),
    jinja: bool = typer.Option(
        True,
        "--jinja/--no-jinja",
        help="render the GGUF's Jinja template (--no-jinja: the built-in format it is detected as)",
        rich_help_panel=CHAT,
    ),
    verbose: bool = typer.Option(
        False,
        "-v",
        "--verbose",
        help="chat: llama.cpp's startup lines instead of the panel, and per-turn token counts",
        rich_help_panel=OUTPUT,
    ),
    simple_io: bool = typer.Option(
        False,
        "--simple-io",
        help="chat: plain input and output (no line editor, colours, panels or bars)",
        rich_help_panel=OUTPUT,
    ),
    show_timings: bool = typer.Option(
        True,
        "--show-timings/--no-show-timings",
        help="chat: [ Prompt | Generation ] speeds after each answer",
        rich_help_panel=OUTPUT,
    ),
) -> None:
    validate.context_flags(ctx_size, batch_size, ubatch_size, threads)
    validate.generation_flags(n_predict, keep)
    validate.at_least("--n-outputs-max", n_outputs_max, "n_outputs_max", 0)
    validate.sampling_flags(temp, top_k, top_p, min_p, seed, repeat_penalty, repeat_last_n)
    validate.n_parallel(parallel)  # these three import the engine's tables: last
    validate.kv_types(ctk, ctv)
    validate.backend(backend)
    chat = (
        conversation
        if conversation is not None
        else ((prompt is None and file is None) or system_prompt is not None or single_turn)
    )
    if not chat and system_prompt is not None:
        err_console.print("warning: -sys is ignored without conversation mode (-no-cnv)", markup=False)
    if prompt is None and file is not None:
        prompt = read_text_file(file)
        if prompt.endswith("\n"):  # llama.cpp's -f drops one trailing newline
            prompt = prompt[:-1]
    if chat:
        if prompt is not None:
            check_text(prompt, "the prompt")
        if system_prompt is not None:
            check_text(system_prompt, "the system prompt")
        if not no_escape:
            prompt = process_escapes(prompt) if prompt is not None else None
            system_prompt = process_escapes(system_prompt) if system_prompt is not None else None
        if chat_template is not None:
            from ..engine.chat_template import load_template

            load_template(chat_template)  # a bad template fails before the model loads
    else:
        if prompt is None:
            prompt = ""
        check_text(prompt, "the prompt")
        if not no_escape:  # like llama.cpp, escapes apply to -p and -f prompts alike
            prompt = process_escapes(prompt)
    # the engine (and torch) load here, not at import: `ubatch tokenize` and --help start fast
    from ..engine.context import Context
    from ..engine.generate import CompletionStats, check_prompt_fits, complete
    from ..engine.model import Model
    from ..engine.params import ContextParams
    from ..engine.report import memory_plan
    from ..engine.sampling import LLAMA_DEFAULT_SEED, Sampler, SamplerParams
    from .memory_view import breakdown_table
    from .present import perf_lines, startup_lines

    t_start = time.perf_counter()
    path = resolve_model(model)
    spinner = chat and not (log_disable or simple_io) and err_console.is_terminal
    with err_console.status("loading the model", spinner="dots") if spinner else contextlib.nullcontext():
        m = Model.load(path)
        params = ContextParams(
            n_ctx=ctx_size,
            n_batch=batch_size,
            n_ubatch=ubatch_size,
            n_seq_max=parallel,
            n_threads=threads if threads > 0 else 0,
            type_k=ctk,
            type_v=ctv,
            swa_full=swa_full,
            kv_unified=kv_unified,
            n_outputs_max=n_outputs_max,
            backend=backend,
        )
        ctx = Context(m, params)
        if chat and not no_warmup:
            ctx.warmup()
    sp = SamplerParams(  # llama.cpp's sampler chain, shared by chat and one-shot
        temp=temp,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=LLAMA_DEFAULT_SEED if seed < 0 else seed,
        repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n,
    )
    if chat:
        from .chat import ChatOptions, run_chat

        opts = ChatOptions(
            system=system_prompt,
            first_prompt=prompt or None,
            single_turn=single_turn,
            chat_template=chat_template,
            use_jinja=jinja,
            verbose=verbose,
            simple_io=simple_io,
            log_disable=log_disable,
            show_timings=show_timings,
            n_predict=n_predict,
            ignore_eos=ignore_eos,
            context_shift=context_shift,
            keep=keep,
        )
        run_chat(ctx, Sampler(sp), opts, (time.perf_counter() - t_start) * 1e3)
        return
    ids = m.vocab.tokenize(prompt, add_special=True, parse_special=True)
    check_prompt_fits(ctx, len(ids))  # before any compute or output
    if not no_warmup:
        ctx.warmup()
    load_ms = (time.perf_counter() - t_start) * 1e3
    if not log_disable:
        for line in startup_lines(ctx):
            err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    sampler = Sampler(sp)
    if not log_disable:
        err_console.print(f"sampler seed: {sampler.seed}", markup=False, highlight=False)
    st = CompletionStats()
    out = sys.stdout
    t0 = time.perf_counter()
    if not no_display_prompt:
        out.write(prompt)
        out.flush()
    n_keep = len(ids) if keep < 0 or keep > len(ids) else keep + int(m.vocab.add_bos)
    if context_shift and not ctx.memory.can_shift:
        err_console.print(
            "warning: context shift is not supported with this KV cache (a sliding-window cache smaller than the context); add --swa-full. Disabling it.",
            markup=False,
        )
        context_shift = False
    for ev in complete(ctx, ids, n_predict, sampler, st, ignore_eos=ignore_eos, ctx_shift=context_shift, n_keep=n_keep):
        if ev.text:
            out.write(ev.text)
            out.flush()
    out.write("\n")
    out.flush()
    total_ms = (time.perf_counter() - t0) * 1e3  # llama.cpp's total: from the prompt eval on, load apart
    if st.stop_reason == "context":
        err_console.print(
            f"context full ({ctx.cparams.n_ctx_seq} tokens) and context shift is disabled: stopping; raise -c or pass --context-shift",
            markup=False,
        )
    if not log_disable:
        err_console.print(
            f"\nubatch: generation stopped: {st.stop_reason}, {st.n_gen} tokens sampled, {st.n_past} in the KV cache",
            markup=False,
            highlight=False,
        )
        for line in perf_lines(ctx, st, load_ms, total_ms):
            err_console.print(line, markup=False, highlight=False, soft_wrap=True)
        err_console.print(breakdown_table(memory_plan(ctx)))
