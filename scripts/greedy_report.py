"""How many greedy tokens match llama.cpp on tests/refdata/greedy.jsonl (up to 32 per prompt), and
whether they equal the greedy tokens of a reference backend (the fp32 torch one by default).

python scripts/greedy_report.py [-m MODEL] [--backend cpu-avx2] [--reference torch]

Exit status 1 where a prompt's greedy tokens differ from the reference backend's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ubatch.engine.completion.complete import complete
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.model.default_model import default_model_path
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams

REF = Path(__file__).resolve().parents[1] / "tests" / "refdata" / "greedy.jsonl"
BACKENDS = "auto, cpu, cpu-avx2, cpu-noamx, cpu-portable, torch"


def greedy(ctx: Context, prompt_ids: list[int], n: int) -> list[int]:
    ctx.memory.clear()
    params = GenerationParams(n_predict=n)
    return [e.token for e in complete(ctx, prompt_ids, Sampler(SamplerParams(temp=0)), params)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("--backend", default="auto", help=f"op backend: {BACKENDS}")
    ap.add_argument("--reference", default="torch", help=f"the backend whose greedy tokens must be equal: {BACKENDS}")
    a = ap.parse_args()
    model = Model.load(a.model or default_model_path())
    ctx = Context(model, ContextParams(n_ctx=512, backend=a.backend))
    ref_ctx = Context(model, ContextParams(n_ctx=512, backend=a.reference))
    print(f"backend {ctx.ops.name}, reference {ref_ctx.ops.name}\n")
    print(f"| prompt | first 8 equal | tokens equal before first divergence (of 32) | equal to {ref_ctx.ops.name} |")
    print("|---|---|---|---|")
    differ = 0
    for line in REF.read_text().splitlines():
        c = json.loads(line)
        lcpp = c["greedy_ids"]
        out = greedy(ctx, c["prompt_ids"], len(lcpp))
        same = out == greedy(ref_ctx, c["prompt_ids"], len(lcpp))
        differ += not same
        n = next((i for i, (x, y) in enumerate(zip(out, lcpp)) if x != y), min(len(out), len(lcpp)))
        print(
            f"| {c['prompt']!r} | {'yes' if out[:8] == lcpp[:8] else 'no'} | {n}/{len(lcpp)} | {'yes' if same else 'NO'} |"
        )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
