"""`ubatch cli` once its flags are checked: load the model and context, then run the chat, the
one-shot completion (llama-completion's output and summary) or the raw-text interactive loop."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ubatch.cli.common import err_console, resolve_model
from ubatch.cli.context_flags import ContextFlags
from ubatch.cli.lora_flags import LoraFlags
from ubatch.cli.parallel_flags import ParallelFlags
from ubatch.cli.sampling_flags import SamplingFlags
from ubatch.cli.spec_flags import SpecFlags

if TYPE_CHECKING:
    from ubatch.cli.complete.prompt_cache_file import PromptCache
    from ubatch.engine.context.context import Context
    from ubatch.engine.generation.generation import GenerationParams
    from ubatch.engine.sampling.chain import Sampler
    from ubatch.engine.spec.speculative import Speculator


@dataclass
class Run:
    """What the command line asked for, checked (cli/complete/command.py builds it)."""

    model: Path | None
    prompt: str | None
    mode: str  # "chat" | "once" | "interactive"
    n_predict: int
    context: ContextFlags  # -c -b -ub -np -kvu --swa-full -ctk -ctv -t --backend
    context_shift: bool
    keep: int
    n_outputs_max: int
    warmup: bool
    display_prompt: bool
    special: bool
    log_disable: bool
    color: str
    system_prompt: str | None
    single_turn: bool
    chat_template: str | None
    jinja: bool
    reverse_prompts: list[str]
    interactive_first: bool
    in_prefix: str
    in_suffix: str
    multiline_input: bool
    verbose: bool
    simple_io: bool
    show_timings: bool
    sampling: SamplingFlags = field(default_factory=SamplingFlags)
    spec: SpecFlags = field(default_factory=SpecFlags)  # speculative decoding (-md, --spec-*)
    tp: ParallelFlags = field(default_factory=ParallelFlags)  # tensor parallelism (-tp, -sm row)
    lora: LoraFlags = field(default_factory=LoraFlags)  # --lora, --lora-scaled
    device: str = "cpu"  # the torch device the model is loaded on (--device, cli/device.py)
    prompt_cache: Path | None = None  # --prompt-cache (cli/complete/prompt_cache_file.py), one-shot only
    prompt_cache_ro: bool = False
    prompt_cache_all: bool = False


def run(r: Run) -> None:
    # the engine (and torch) load here, not at import: `ubatch tokenize` and --help start fast
    from ubatch.engine.context.context import Context
    from ubatch.engine.sampling.chain import Sampler

    t_start = time.perf_counter()
    path = resolve_model(r.model)
    chat = r.mode == "chat"
    spinner = chat and not (r.log_disable or r.simple_io) and err_console.is_terminal
    with err_console.status("loading the model", spinner="dots") if spinner else contextlib.nullcontext():
        m = r.tp.load(path, r.device)
        lora = r.lora.load(m)  # before the context, which reserves room for the adapters
        ctx = Context(m, r.context.params(n_outputs_max=r.n_outputs_max, spec=r.spec.params()))
        ctx.set_adapters(lora)
        speculator = r.spec.build(ctx)  # the draft model, if any, loads here too
        if chat and r.warmup:
            ctx.warmup()
    sp = r.sampling.sampler_params()  # llama.cpp's sampler chain, shared by every mode
    if chat:
        from ubatch.cli.complete.chat import ChatOptions, run_chat

        opts = ChatOptions(
            system=r.system_prompt,
            first_prompt=r.prompt or None,
            single_turn=r.single_turn,
            chat_template=r.chat_template,
            use_jinja=r.jinja,
            verbose=r.verbose,
            simple_io=r.simple_io,
            log_disable=r.log_disable,
            show_timings=r.show_timings,
            generation=generation_params(r, ctx, r.context_shift, r.keep),
            color=r.color,
            speculator=speculator,
        )
        status = run_chat(ctx, Sampler(sp, ctx.cparams.n_ctx_seq, m.vocab), opts, (time.perf_counter() - t_start) * 1e3)
        if status:
            import typer

            raise typer.Exit(status)
        return
    once(r, ctx, Sampler(sp, ctx.cparams.n_ctx_seq, m.vocab), t_start, speculator)


def generation_params(r: Run, ctx: Context, ctx_shift: bool, n_keep: int) -> GenerationParams:
    """What every answer asks (-n, --ignore-eos, -r, -l, the grammar, -sp), with the context
    shift as the mode resolved it (the chat keeps --keep as typed, the completion counts tokens)."""
    from ubatch.engine.generation.generation import GenerationParams

    return GenerationParams(
        n_predict=r.n_predict,
        stop=list(r.reverse_prompts),
        ignore_eos=r.sampling.ignore_eos,
        logit_bias=r.sampling.logit_biases(ctx.model.hparams.n_vocab),
        ctx_shift=ctx_shift,
        n_keep=n_keep,
        special=r.special,
        grammar=r.sampling.compiled_grammar(),
    )


def once(r: Run, ctx: Context, sampler: Sampler, t_start: float, speculator: Speculator | None = None) -> None:
    """llama-completion: the prompt, its continuation streamed to stdout, then the summary;
    with -i the loop in cli/complete/interactive.py takes over after the first answer."""
    from ubatch.cli.memory_view import breakdown_table
    from ubatch.cli.present import PROMPT_COLOUR, RESET, perf_lines, startup_lines
    from ubatch.cli.spec_view import spec_startup_lines, spec_summary_lines
    from ubatch.engine.completion.complete import CompletionStats, check_prompt_fits, complete
    from ubatch.engine.context.report import memory_plan

    m = ctx.model
    prompt = r.prompt or ""
    ids = m.vocab.tokenize(prompt, add_special=True, parse_special=True) if prompt or r.mode != "interactive" else []
    if ids or r.mode != "interactive":
        check_prompt_fits(ctx, len(ids))  # before any compute or output
    if r.warmup:
        ctx.warmup()
    pc, n_past, cache = prompt_cache(r, ctx, ids)  # after the warmup, which clears the cache
    load_ms = (time.perf_counter() - t_start) * 1e3
    if not r.log_disable:
        for line in startup_lines(ctx) + r.tp.lines() + spec_startup_lines(speculator, ctx):
            err_console.print(line, markup=False, highlight=False, soft_wrap=True)
        err_console.print(f"sampler seed: {sampler.seed}", markup=False, highlight=False)
    context_shift = r.context_shift
    if context_shift and not ctx.memory.can_shift:
        err_console.print(
            "warning: context shift is not supported with this KV cache (a sliding-window cache smaller than the context); add --swa-full. Disabling it.",
            markup=False,
        )
        context_shift = False
    st = CompletionStats()
    out = sys.stdout
    t0 = time.perf_counter()
    colour = r.color == "on" or (r.color == "auto" and out.isatty())
    if r.display_prompt:  # llama-completion's colours: the prompt yellow, what you type green
        out.write(f"{PROMPT_COLOUR}{prompt}{RESET}" if colour and prompt else prompt)
        out.flush()
    n_keep = len(ids) if r.keep < 0 or r.keep > len(ids) else r.keep + int(m.vocab.add_bos)
    gen = generation_params(r, ctx, context_shift, n_keep)
    if r.mode == "interactive":
        from ubatch.cli.complete.interactive import interact

        interact(r, ctx, sampler, ids, st, gen, colour, speculator)
    else:
        for ev in complete(ctx, ids[n_past:], sampler, gen, st, cache=cache, speculator=speculator):
            if pc is not None:
                pc.after_prompt(ctx, cache)  # once, before the first sampled token is decoded
            if ev.text:
                out.write(ev.text)
                out.flush()
        if pc is not None:
            pc.after_prompt(ctx, cache)
            pc.at_end(ctx, cache)
        if st.stop_reason == "word":  # llama-completion prints the reverse prompt it stopped at
            out.write(st.stopping_word)
    out.write("\n")
    out.flush()
    total_ms = (time.perf_counter() - t0) * 1e3  # llama.cpp's total: from the prompt eval on, load apart
    if st.stop_reason == "context":
        err_console.print(
            f"context full ({ctx.cparams.n_ctx_seq} tokens) and context shift is disabled: stopping; raise -c or pass --context-shift",
            markup=False,
        )
    if not r.log_disable:
        err_console.print(
            f"\nubatch: generation stopped: {st.stop_reason}, {st.n_gen} tokens sampled, {st.n_past} in the KV cache",
            markup=False,
            highlight=False,
        )
        for line in perf_lines(ctx, st, load_ms, total_ms) + spec_summary_lines(st.spec):
            err_console.print(line, markup=False, highlight=False, soft_wrap=True)
        err_console.print(breakdown_table(memory_plan(ctx)))


def prompt_cache(r: Run, ctx: Context, ids: list[int]) -> tuple[PromptCache | None, int, list[int]]:
    """--prompt-cache: the restored prefix (n_past) and the token list complete() keeps true."""
    if r.prompt_cache is None:
        return None, 0, []
    from ubatch.cli.complete.prompt_cache_file import PromptCache

    pc = PromptCache(r.prompt_cache, r.prompt_cache_ro, r.prompt_cache_all, r.log_disable)
    n_past = pc.restore(ctx, ids)
    return pc, n_past, ids[:n_past]
