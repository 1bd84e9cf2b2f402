"""How many greedy tokens match llama.cpp on tests/refdata/greedy.jsonl (up to 32 per prompt).

python scripts/greedy_report.py [-m MODEL]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ubatch.engine.completion.complete import complete
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.model.default_model import default_model_path
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams

REF = Path(__file__).resolve().parents[1] / "tests" / "refdata" / "greedy.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    a = ap.parse_args()
    ctx = Context(Model.load(a.model or default_model_path()), ContextParams(n_ctx=512))
    print("| prompt | first 8 equal | tokens equal before first divergence (of 32) |")
    print("|---|---|---|")
    for line in REF.read_text().splitlines():
        c = json.loads(line)
        ctx.memory.clear()
        ref = c["greedy_ids"]
        out = [
            e.token
            for e in complete(
                ctx, c["prompt_ids"], Sampler(SamplerParams(temp=0)), GenerationParams(n_predict=len(ref))
            )
        ]
        n = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
        print(f"| {c['prompt']!r} | {'yes' if out[:8] == ref[:8] else 'no'} | {n}/{len(ref)} |")


if __name__ == "__main__":
    main()
