"""`ubatch explain`: run a request for real and show how it was batched, split, padded, masked
and where the memory went, from the engine's own records (engine/explain/); drawn by
cli/explain/view.py, or as JSON with --json (cli/explain/json_view.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ubatch.cli import validate
from ubatch.cli.common import check_text, err_console, process_escapes, resolve_model, user_errors
from ubatch.cli.context_flags import ContextFlags, context_options
from ubatch.cli.flag_group import refine
from ubatch.cli.lora_flags import LoraFlags, lora_options_cli
from ubatch.cli.options import opt
from ubatch.cli.parallel_flags import ParallelFlags, parallel_options
from ubatch.cli.sampling_flags import SamplingFlags, sampling_options
from ubatch.cli.spec_flags import SpecFlags, spec_options

WHAT_IF_UBATCHES = (512, 256, 128, 64)


@user_errors
@context_options({"parallel": refine(-1, help="slots, as llama-server's -np (-1 = one per -p)")})
@sampling_options
@spec_options
@parallel_options
@lora_options_cli
def explain(
    model: Optional[Path] = opt("model", None),
    prompt: Optional[list[str]] = opt("prompt", None, help="a prompt; repeat -p for sequences decoded together"),
    n_predict: int = opt("n_predict", 4, help="tokens to generate per prompt (-1 = until end of generation)"),
    device: str = opt("device", "auto"),
    escape: bool = typer.Option(True, "--escape/--no-escape", "-e", help="process \\n, \\t, \\xHH escapes in prompts"),
    as_json: bool = typer.Option(False, "--json", help="print the explanation as JSON"),
    context: ContextFlags = ContextFlags(),
    sampling: SamplingFlags = SamplingFlags(),
    spec: SpecFlags = SpecFlags(),
    tp: ParallelFlags = ParallelFlags(),
    lora: LoraFlags = LoraFlags(),
) -> None:
    if not prompt:
        raise typer.BadParameter("give at least one prompt to explain", param_hint="-p")
    validate.generation_flags(n_predict)
    sampling.check()
    lora.check()
    for note in spec.check():
        err_console.print(note, markup=False, soft_wrap=True)
    validate.n_parallel(len(prompt), flag="-p (one sequence each)")
    tp.check()
    context.check(parallel_auto=True)  # last: it imports the engine's tables
    n_slots = context.parallel if context.parallel > 0 else len(prompt)
    from ubatch.cli.device import resolve_device

    dev, context.backend = resolve_device(device, context.backend)
    tp.follow(dev)
    sampling.compiled_grammar()  # a grammar that does not parse fails before the model loads
    texts = [check_text(process_escapes(p) if escape else p, f"prompt {i + 1}") for i, p in enumerate(prompt)]
    from ubatch.cli.explain.run import Request, explain_request
    from ubatch.engine.serve.task import TaskParams

    m = tp.load(resolve_model(model), dev)
    scales = lora.load(m)  # every prompt applies them (the server's global scales)
    ids = [m.vocab.tokenize(t, add_special=True, parse_special=True) for t in texts]
    # as llama-server: one output row per slot, and with speculation one per drafted token
    params = context.params(parallel=n_slots, spec=spec.params())
    task = TaskParams(n_predict, sampling.sampler_params(), ignore_eos=sampling.ignore_eos)
    task.logit_bias, task.grammar = sampling.logit_biases(m.hparams.n_vocab), sampling.compiled_grammar()
    # the Speculator for the target context (None: speculation off)
    req = Request(ids, task, n_slots, spec.build, scales)
    e = explain_request(m, params, req, WHAT_IF_UBATCHES)
    if as_json:
        from ubatch.cli.explain.json_view import explanation_json

        print(json.dumps(explanation_json(e), indent=1))
        return
    from ubatch.cli.explain.view import render
    from ubatch.cli.memory_view import table_console

    render(e, table_console())
