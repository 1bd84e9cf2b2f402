"""`ubatch info`: the whole memory plan of a configuration, without running a prompt."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import typer

from ubatch.cli import validate
from ubatch.cli.common import resolve_model, user_errors
from ubatch.cli.context_flags import ContextFlags, context_options
from ubatch.cli.lora_flags import LoraFlags, lora_options_cli
from ubatch.cli.options import opt
from ubatch.cli.parallel_flags import ParallelFlags, parallel_options
from ubatch.engine.errors import UbatchError


def parse_bytes(text: str) -> int:
    """'1073741824', '1.5G', '800M', '512MiB' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise UbatchError(f"--fit {text!r}: not a size; use bytes or a number with K, M, G (e.g. 1.5G)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    n = int(float(m.group(1)) * mult)
    if n <= 0:
        raise UbatchError(f"--fit {text!r}: invalid value for the memory budget: must be above 0 bytes")
    return n


@user_errors
@context_options(omit=("threads",), panel="Options")  # sizes only: no thread runs
@parallel_options
@lora_options_cli
def info(
    model: Optional[Path] = opt("model", None, panel="Options"),
    device: str = opt("device", "auto", panel="Options"),
    n_outputs_max: Optional[int] = typer.Option(
        None,
        "--n-outputs-max",
        help="output rows reserved (default: one per sequence, as ubatch's commands and llama-server; 0 = n_batch, llama-completion's choice)",
    ),
    fit_budget: Optional[str] = typer.Option(
        None, "--fit", help="memory budget (e.g. 1.5G): pick the largest -c, and -ub/-np if needed, that fit"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    verbose: bool = opt("verbose", False, help="also print llama.cpp-format startup lines", panel="Options"),
    context: ContextFlags = ContextFlags(),
    tp: ParallelFlags = ParallelFlags(),
    lora: LoraFlags = LoraFlags(),
) -> None:
    """The plan of one process, or with -tp N of one rank (no rank is started: sizes only).
    `-tp 0 --fit B -c N`: the fewest ranks whose per-rank plan of that context fits B."""
    if n_outputs_max is not None:
        validate.at_least("--n-outputs-max", n_outputs_max, "n_outputs_max", 0)
    budget = parse_bytes(fit_budget) if fit_budget is not None else None
    ranks_needed = tp.tensor_parallel == 0
    if ranks_needed:
        if budget is None or context.ctx_size <= 0:
            raise UbatchError(
                "-tp 0 asks how many ranks a context needs: give the context with -c N and the budget per rank with --fit"
            )
        tp.tensor_parallel = 1
    tp.check()
    lora.check()
    context.check()  # last: it imports the engine's tables
    from ubatch.cli.device import resolve_device

    dev, context.backend = resolve_device(device, context.backend)  # the plan of that device's buffers
    from ubatch.cli.memory_view import breakdown_table, plan_json, plan_table, table_console
    from ubatch.cli.present import startup_lines
    from ubatch.engine.context.report import fit, plan_for
    from ubatch.engine.model.model import Model

    whole = Model.load(resolve_model(model), dev)
    lora.load(whole)  # counted in the plan (memory and the worst-case graphs)
    m = tp.plan_model(whole, dev.type == "cuda")
    params = context.params(n_outputs_max=n_outputs_max)
    if ranks_needed:
        assert budget is not None
        from ubatch.cli.parallel_flags import ranks_for

        world, plan = ranks_for(whole, params, budget)
        if as_json:
            print(
                json.dumps(
                    {"budget_bytes": budget, "n_ctx": params.n_ctx, "tensor_parallel": world, "plan": plan_json(plan)},
                    indent=1,
                )
            )
            return
        out = table_console()
        out.print(f"-c {params.n_ctx} within {fit_budget} per rank: -tp {world}")
        out.print(plan_table(plan))
        return
    # sized from shapes: info allocates none of the buffers it reports
    params, plan = fit(m, params, budget) if budget is not None else (params, plan_for(m, params))
    if as_json:
        d = plan_json(plan)
        if fit_budget is not None:
            d["fit"] = {
                "budget_bytes": budget,
                "n_ctx": params.n_ctx,
                "n_ubatch": params.n_ubatch,
                "n_seq_max": params.n_seq_max,
            }
        print(json.dumps(d, indent=1))
        return
    out = table_console()  # a file or pipe gets whole rows, not wrapped ones
    if verbose:
        for line in startup_lines(None, plan, model=m, params=params):
            out.print(line, markup=False, highlight=False, soft_wrap=True)
    if fit_budget is not None:
        out.print(f"fit {fit_budget}: -c {params.n_ctx} -ub {params.n_ubatch} -np {params.n_seq_max}")
    out.print(plan_table(plan))
    out.print(breakdown_table(plan))
