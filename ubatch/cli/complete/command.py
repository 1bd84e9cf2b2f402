"""`ubatch cli`: llama-cli and llama-completion in one command. A conversation in the terminal (no
-p, or -cnv / -sys / -st), a one-shot completion with -p or -f, or llama-completion's raw-text
interactive mode with -i / -if (and -r reverse prompts). This module is the command line: the
flags and the checks that run before anything loads; cli/complete/run.py runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ubatch.cli import validate
from ubatch.cli.common import check_text, err_console, process_escapes, read_text_file, user_errors
from ubatch.cli.context_flags import ContextFlags, context_options
from ubatch.cli.lora_flags import LoraFlags, lora_options_cli
from ubatch.cli.options import CHAT, OUTPUT, PROMPT_CACHE, in_panel, opt
from ubatch.cli.parallel_flags import ParallelFlags, parallel_options
from ubatch.cli.sampling_flags import SamplingFlags, sampling_options
from ubatch.cli.spec_flags import SpecFlags, spec_options

_chat, _output = in_panel(CHAT), in_panel(OUTPUT)


@user_errors
@context_options()
@sampling_options
@spec_options
@parallel_options
@lora_options_cli
def cli(
    model: Optional[Path] = opt("model", None),
    prompt: Optional[str] = opt("prompt", None),
    file: Optional[Path] = opt("file", None),
    n_predict: int = opt("n_predict", -1),
    context_shift: bool = opt(
        "context_shift", False, help="when the context is full, drop half of it and go on (chat: oldest messages)"
    ),
    keep: int = opt("keep", 0, help="tokens of the prompt kept by a context shift (-1 = all; chat: the first prompt)"),
    n_outputs_max: int = opt(
        "n_outputs_max", 1, help="output rows the compute buffer is reserved for (0 = n_batch, llama-completion's)"
    ),
    device: str = opt("device", "auto"),
    warmup: bool = opt("warmup", True),
    escape: bool = _output(True, "--escape/--no-escape", "-e", help="process \\n, \\t, \\xHH escapes in prompts"),
    display_prompt: bool = _output(
        True, "--display-prompt/--no-display-prompt", help="echo the prompt before the output"
    ),
    log_disable: bool = opt("log_disable", False),
    special: bool = opt("special", False),
    color: str = _output("auto", "-co", "--color", help="colour prompt, input and output: on, off, auto (a terminal)"),
    conversation: Optional[bool] = _chat(
        None,
        "--conversation/--no-conversation",
        "-cnv/-no-cnv",
        help="chat (default without -p / -f) or one-shot completion (default with -p / -f)",
        show_default=False,
    ),
    system_prompt: Optional[str] = _chat(None, "-sys", "--system-prompt", help="system prompt (starts a conversation)"),
    system_prompt_file: Optional[Path] = _chat(
        None, "-sysf", "--system-prompt-file", help="the system prompt from a file"
    ),
    single_turn: bool = _chat(
        False, "-st", "--single-turn", help="answer one message (-p, or the first typed) and exit"
    ),
    chat_template: Optional[str] = opt("chat_template", None),
    chat_template_file: Optional[Path] = opt("chat_template_file", None),
    jinja: bool = opt("jinja", True),
    reverse_prompt: Optional[list[str]] = _chat(
        None, "-r", "--reverse-prompt", help="stop at this text (-i: hand over to you); repeatable"
    ),
    interactive: bool = _chat(False, "-i", "--interactive", help="raw-text interactive mode (llama-completion -i)"),
    interactive_first: bool = _chat(False, "-if", "--interactive-first", help="-i, waiting for your input first"),
    in_prefix: str = _chat("", "--in-prefix", help="-i: text before each input"),
    in_suffix: str = _chat("", "--in-suffix", help="-i: text after each input"),
    multiline_input: bool = _chat(
        False, "-mli", "--multiline-input", help="-i: read input until a line ending in \\ is not"
    ),
    verbose: bool = opt("verbose", False, help="chat: llama.cpp's startup lines instead of the panel; token counts"),
    simple_io: bool = _output(
        False, "--simple-io", help="plain input and output (no line editor, colours, panels or bars)"
    ),
    show_timings: bool = _output(True, "--show-timings/--no-show-timings", help="chat: speeds after each answer"),
    prompt_cache: Optional[Path] = typer.Option(
        None,
        "--prompt-cache",
        help="one-shot: reuse the KV state saved in this file, save it after the prompt",
        rich_help_panel=PROMPT_CACHE,
    ),
    prompt_cache_all: bool = typer.Option(
        False,
        "--prompt-cache-all",
        help="--prompt-cache: save the generated text's state too",
        rich_help_panel=PROMPT_CACHE,
    ),
    prompt_cache_ro: bool = typer.Option(
        False, "--prompt-cache-ro", help="--prompt-cache: use the file, never update it", rich_help_panel=PROMPT_CACHE
    ),
    context: ContextFlags = ContextFlags(),
    sampling: SamplingFlags = SamplingFlags(),
    spec: SpecFlags = SpecFlags(),
    lora: LoraFlags = LoraFlags(),
    tp: ParallelFlags = ParallelFlags(),
) -> None:
    validate.generation_flags(n_predict, keep)
    validate.at_least("--n-outputs-max", n_outputs_max, "n_outputs_max", 0)
    validate.choice("-co", color, "color", ("on", "off", "auto"))
    sampling.check()
    lora.check()
    for note in spec.check():
        err_console.print(note, markup=False, soft_wrap=True)
    tp.check()
    context.check()  # last: it imports the engine's tables
    from ubatch.cli.device import resolve_device

    dev, context.backend = resolve_device(device, context.backend)  # --device cuda without a GPU: one line, exit 1
    tp.follow(dev)
    from ubatch.cli.complete.run import Run, run

    if interactive_first:
        interactive = True
    if system_prompt is None and system_prompt_file is not None:
        system_prompt = read_text_file(system_prompt_file, "system prompt file")
    if chat_template is None and chat_template_file is not None:
        chat_template = str(chat_template_file)
    chat = (
        conversation
        if conversation is not None
        else not interactive and ((prompt is None and file is None) or system_prompt is not None or single_turn)
    )
    if not chat and system_prompt is not None:
        err_console.print("warning: -sys is ignored without conversation mode (-no-cnv)", markup=False)
    if prompt is None and file is not None:
        prompt = read_text_file(file)
        if prompt.endswith("\n"):  # llama.cpp's -f drops one trailing newline
            prompt = prompt[:-1]
    if prompt is not None:
        check_text(prompt, "the prompt")
    if system_prompt is not None:
        check_text(system_prompt, "the system prompt")
    if escape:  # like llama.cpp, escapes apply to -p, -f, -sys, -r and the prefixes alike
        prompt = process_escapes(prompt) if prompt is not None else None
        system_prompt = process_escapes(system_prompt) if system_prompt is not None else None
        reverse_prompt = [process_escapes(r) for r in reverse_prompt or []]
        in_prefix, in_suffix = process_escapes(in_prefix), process_escapes(in_suffix)
    if prompt_cache is not None and (chat or interactive):
        err_console.print(
            "warning: --prompt-cache is used by one-shot completions (-no-cnv, no -i); ignored", markup=False
        )
        prompt_cache = None
    if prompt_cache is not None and prompt_cache.is_dir():
        raise typer.BadParameter(f"{prompt_cache} is a directory", param_hint="--prompt-cache")
    if chat and chat_template is not None:
        from ubatch.engine.chat.template import load_template

        load_template(chat_template)  # a bad template fails before the model loads
    sampling.compiled_grammar()  # a grammar that does not parse fails before the model loads
    run(
        Run(
            model=model,
            prompt=prompt,
            mode="chat" if chat else "interactive" if interactive else "once",
            n_predict=n_predict,
            context=context,
            context_shift=context_shift,
            keep=keep,
            n_outputs_max=n_outputs_max,
            device=str(dev),
            warmup=warmup,
            display_prompt=display_prompt,
            special=special,
            log_disable=log_disable,
            color=color,
            system_prompt=system_prompt,
            single_turn=single_turn,
            chat_template=chat_template,
            jinja=jinja,
            reverse_prompts=list(reverse_prompt or []),
            interactive_first=interactive_first,
            in_prefix=in_prefix,
            in_suffix=in_suffix,
            multiline_input=multiline_input,
            verbose=verbose,
            simple_io=simple_io,
            show_timings=show_timings,
            sampling=sampling,
            spec=spec,
            tp=tp,
            lora=lora,
            prompt_cache=prompt_cache,
            prompt_cache_ro=prompt_cache_ro,
            prompt_cache_all=prompt_cache_all,
        )
    )
