"""Where the Python part of a one-stream server step goes (issue 47): the default model (or -m),
one slot, greedy, and per step the time of `Scheduler.step` split into the graph's run (the C
calls, `run_step`) and the Python around it: validation, `init_batch`, placing the ubatch, the
step inputs, sampling, and the rest (scheduling, bookkeeping, events). Medians over the steps
of each run, then the median of the runs (the machine may be shared: several runs, one table).
The steps run in inference mode, as the server's engine thread runs them.

    python scripts/step_profile.py [-m MODEL] [--steps 64] [--runs 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ubatch.engine.context import context as context_mod
from ubatch.engine.context.context import Context
from ubatch.engine.context.step_inputs import StepInputs
from ubatch.engine.generation.generation import Generation
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.model.default_model import default_model_path
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import SamplerParams
from ubatch.engine.serve import runner as runner_mod
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.serve.task import Task, TaskParams

PARTS = ("validate", "init_batch", "place", "step_inputs", "graph", "sample")
spent: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[name] += time.perf_counter() - t0

    return wrapper


def instrument() -> None:
    Context.validate = timed("validate", Context.validate)  # type: ignore[method-assign]
    KVMemory.init_batch = timed("init_batch", KVMemory.init_batch)  # type: ignore[method-assign]
    KVMemory.place = timed("place", KVMemory.place)  # type: ignore[method-assign]
    StepInputs.fill = timed("step_inputs", StepInputs.fill)  # type: ignore[method-assign]
    context_mod.run_step = timed("graph", context_mod.run_step)  # type: ignore[attr-defined]
    Generation.sample = timed("sample", Generation.sample)  # type: ignore[method-assign]
    if hasattr(runner_mod, "sample_rows"):  # the batched pass (and what follows each row's draw)
        runner_mod.sample_rows = timed("sample", runner_mod.sample_rows)  # type: ignore[attr-defined]
        Generation.took = timed("sample", Generation.took)  # type: ignore[attr-defined]


def one_run(model: Model, n_threads: int, steps: int, temp: float) -> dict[str, float]:
    ctx = Context(model, ContextParams(n_ctx=4096, n_seq_max=1, n_outputs_max=1, n_threads=n_threads))
    ctx.warmup()
    sch = Scheduler(ctx, 1)
    params = TaskParams(n_predict=steps + 8, ignore_eos=True, sampling=SamplerParams(temp=temp, seed=42))
    sch.accept(Task(0, [model.vocab.bos] + [1000 + i for i in range(32)], params, lambda e: None))
    per_step: dict[str, list[float]] = defaultdict(list)
    for i in range(steps + 4):
        spent.clear()
        t0 = time.perf_counter()
        sch.step()
        total = time.perf_counter() - t0
        if i < 4:  # the prompt, then the first steps (graphs bound): not a steady step
            continue
        per_step["step"].append(total * 1e3)
        for k in PARTS:
            per_step[k].append(spent[k] * 1e3)
        per_step["python"].append((total - spent["graph"]) * 1e3)
        per_step["other"].append((total - sum(spent.values())) * 1e3)
    return {k: statistics.median(v) for k, v in per_step.items()}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temp", type=float, default=0.8, help="0: greedy; the default samples the common chain")
    a = ap.parse_args()
    model = Model.load(a.model or default_model_path())
    instrument()
    with torch.inference_mode():  # as the server's engine thread runs
        runs = [one_run(model, a.threads, a.steps, a.temp) for _ in range(a.runs)]
    cols = ["step", "graph", "python", *[p for p in PARTS if p != "graph"], "other"]
    print(f"CPU: {cpu_name()}; {a.threads} threads; {a.runs} runs of {a.steps} one-token steps; temp {a.temp}")
    print("| run | " + " | ".join(f"{c} ms" for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for i, r in enumerate(runs):
        print(f"| {i} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    med = {c: statistics.median(r[c] for r in runs) for c in cols}
    print("| median | " + " | ".join(f"{med[c]:.3f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
