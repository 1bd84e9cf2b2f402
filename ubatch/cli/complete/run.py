"""`ubatch cli` once its flags are checked: load the model and context, then run the chat, the
one-shot completion (llama-completion's output and summary) or the raw-text interactive loop."""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ubatch.cli.common import err_console, resolve_model
from ubatch.cli.context_flags import ContextFlags
from ubatch.cli.flag_group import flag, shared_flag
from ubatch.cli.lora_flags import LoraFlags
from ubatch.cli.options import CHAT, OUTPUT, PROMPT_CACHE
from ubatch.cli.parallel_flags import ParallelFlags
from ubatch.cli.sampling_flags import SamplingFlags
from ubatch.cli.spec_flags import SpecFlags

if TYPE_CHECKING:
    from ubatch.cli.complete.prompt_cache_file import PromptCache
    from ubatch.engine.context.context import Context
    from ubatch.engine.generation.generation import GenerationParams
    from ubatch.engine.sampling.chain import Sampler
    from ubatch.engine.spec.speculative import Speculator


_chat, _output = (functools.partial(flag, panel=p) for p in (CHAT, OUTPUT))


@dataclass
class Run:
    """What the command line asked for, checked (cli/complete/command.py fills it in). A field
    that is a flag (`flag`, `shared_flag`) is declared here once: cli/flag_group.py makes it the
    command's option; the others come from several flags."""

    model: Optional[Path] = shared_flag("model", None)
    prompt: Optional[str] = shared_flag("prompt", None)  # -p, or -f's text; escapes processed
    mode: str = "once"  # "chat" | "once" | "interactive"
    n_predict: int = shared_flag("n_predict", -1)
    context: ContextFlags = field(default_factory=ContextFlags)  # -c -b -ub -np -kvu --swa-full -ctk -ctv -t --backend
    context_shift: bool = shared_flag(
        "context_shift", False, help="when the context is full, drop half of it and go on (chat: oldest messages)"
    )
    keep: int = shared_flag(
        "keep", 0, help="tokens of the prompt kept by a context shift (-1 = all; chat: the first prompt)"
    )
    n_outputs_max: int = shared_flag(
        "n_outputs_max", 1, help="output rows the compute buffer is reserved for (0 = n_batch, llama-completion's)"
    )
    warmup: bool = shared_flag("warmup", True)
    display_prompt: bool = _output(
        True, "--display-prompt/--no-display-prompt", help="echo the prompt before the output"
    )
    special: bool = shared_flag("special", False)
    log_disable: bool = shared_flag("log_disable", False)
    color: str = _output("auto", "-co", "--color", help="colour prompt, input and output: on, off, auto (a terminal)")
    system_prompt: Optional[str] = _chat(
        None, "-sys", "--system-prompt", help="system prompt (starts a conversation)"
    )  # or -sysf's text
    single_turn: bool = _chat(
        False, "-st", "--single-turn", help="answer one message (-p, or the first typed) and exit"
    )
    chat_template: Optional[str] = shared_flag("chat_template", None)  # or --chat-template-file's path
    jinja: bool = shared_flag("jinja", True)
    reverse_prompts: list[str] = field(default_factory=list)  # -r, escapes processed
    interactive_first: bool = _chat(False, "-if", "--interactive-first", help="-i, waiting for your input first")
    in_prefix: str = _chat("", "--in-prefix", help="-i: text before each input")
    in_suffix: str = _chat("", "--in-suffix", help="-i: text after each input")
    multiline_input: bool = _chat(
        False, "-mli", "--multiline-input", help="-i: read input until a line ending in \\ is not"
    )
    verbose: bool = shared_flag(
        "verbose", False, help="chat: llama.cpp's startup lines instead of the panel; token counts"
    )
    simple_io: bool = _output(
        False, "--simple-io", help="plain input and output (no line editor, colours, panels or bars)"
    )
    show_timings: bool = _output(True, "--show-timings/--no-show-timings", help="chat: speeds after each answer")
    sampling: SamplingFlags = field(default_factory=SamplingFlags)
    spec: SpecFlags = field(default_factory=SpecFlags)  # speculative decoding (-md, --spec-*)
    tp: ParallelFlags = field(default_factory=ParallelFlags)  # tensor parallelism (-tp, -sm row)
    lora: LoraFlags = field(default_factory=LoraFlags)  # --lora, --lora-scaled
    device: str = "cpu"  # the torch device the model is loaded on (--device, cli/device.py)
    # --prompt-cache (cli/complete/prompt_cache_file.py), one-shot only
    prompt_cache: Optional[Path] = flag(
        None,
        "--prompt-cache",
        help="one-shot: reuse the KV state saved in this file, save it after the prompt",
        panel=PROMPT_CACHE,
    )
    prompt_cache_ro: bool = flag(
        False, "--prompt-cache-ro", help="--prompt-cache: use the file, never update it", panel=PROMPT_CACHE
    )
    prompt_cache_all: bool = flag(
        False, "--prompt-cache-all", help="--prompt-cache: save the generated text's state too", panel=PROMPT_CACHE
    )


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
