"""`ubatch cli`: llama-cli and llama-completion in one command. A conversation in the terminal (no
-p, or -cnv / -sys / -st), a one-shot completion with -p or -f, or llama-completion's raw-text
interactive mode with -i / -if (and -r reverse prompts). This module is the command line: the
flags and the checks that run before anything loads; cli/complete/run.py runs it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from ubatch.cli import validate
from ubatch.cli.common import check_text, err_console, process_escapes, read_text_file, user_errors
from ubatch.cli.complete.run import Run
from ubatch.cli.context_flags import ContextFlags, context_options
from ubatch.cli.flag_group import flag_group
from ubatch.cli.lora_flags import LoraFlags, lora_options_cli
from ubatch.cli.options import CHAT, OUTPUT, in_panel, opt
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
@flag_group(Run, "r")
def cli(
    file: Optional[Path] = opt("file", None),
    device: str = opt("device", "auto"),
    escape: bool = _output(True, "--escape/--no-escape", "-e", help="process \\n, \\t, \\xHH escapes in prompts"),
    conversation: Optional[bool] = _chat(
        None,
        "--conversation/--no-conversation",
        "-cnv/-no-cnv",
        help="chat (default without -p / -f) or one-shot completion (default with -p / -f)",
        show_default=False,
    ),
    system_prompt_file: Optional[Path] = _chat(
        None, "-sysf", "--system-prompt-file", help="the system prompt from a file"
    ),
    chat_template_file: Optional[Path] = opt("chat_template_file", None),
    reverse_prompt: Optional[list[str]] = _chat(
        None, "-r", "--reverse-prompt", help="stop at this text (-i: hand over to you); repeatable"
    ),
    interactive: bool = _chat(False, "-i", "--interactive", help="raw-text interactive mode (llama-completion -i)"),
    r: Run = Run(),
    context: ContextFlags = ContextFlags(),
    sampling: SamplingFlags = SamplingFlags(),
    spec: SpecFlags = SpecFlags(),
    lora: LoraFlags = LoraFlags(),
    tp: ParallelFlags = ParallelFlags(),
) -> None:
    validate.generation_flags(r.n_predict, r.keep)
    validate.at_least("--n-outputs-max", r.n_outputs_max, "n_outputs_max", 0)
    validate.choice("-co", r.color, "color", ("on", "off", "auto"))
    sampling.check()
    lora.check()
    for note in spec.check():
        err_console.print(note, markup=False, soft_wrap=True)
    tp.check()
    context.check()  # last: it imports the engine's tables
    from ubatch.cli.device import resolve_device

    dev, context.backend = resolve_device(device, context.backend)  # --device cuda without a GPU: one line, exit 1
    tp.follow(dev)
    from ubatch.cli.complete.run import run

    prompt, system_prompt, chat_template, prompt_cache = r.prompt, r.system_prompt, r.chat_template, r.prompt_cache
    in_prefix, in_suffix = r.in_prefix, r.in_suffix
    if r.interactive_first:
        interactive = True
    if system_prompt is None and system_prompt_file is not None:
        system_prompt = read_text_file(system_prompt_file, "system prompt file")
    if chat_template is None and chat_template_file is not None:
        chat_template = str(chat_template_file)
    chat = (
        conversation
        if conversation is not None
        else not interactive and ((prompt is None and file is None) or system_prompt is not None or r.single_turn)
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
        reverse_prompt = [process_escapes(x) for x in reverse_prompt or []]
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
        replace(
            r,
            prompt=prompt,
            mode="chat" if chat else "interactive" if interactive else "once",
            context=context,
            device=str(dev),
            system_prompt=system_prompt,
            chat_template=chat_template,
            reverse_prompts=list(reverse_prompt or []),
            in_prefix=in_prefix,
            in_suffix=in_suffix,
            sampling=sampling,
            spec=spec,
            tp=tp,
            lora=lora,
            prompt_cache=prompt_cache,
        )
    )
