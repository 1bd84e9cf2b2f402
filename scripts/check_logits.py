"""Teacher-forced logits of ubatch vs the fp32 reference, next to llama.cpp's own distance.

    python scripts/check_logits.py [-m MODEL] [-ctk f16] [-ub 512] [--backend cpu-avx2]

Prints, per reference text: mean/max KLD over the reference's top-32 tokens and top-1
agreement, for ubatch and for llama.cpp (tests/refdata/logits_lcpp_vs_ref.json). The bar: ubatch's
mean KLD at most 1/100 of llama.cpp's on every text (exit status 1 where it is not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REFDATA = Path(__file__).resolve().parents[1] / "tests" / "refdata"


def main() -> int:
    from ubatch.engine.context.context import Context
    from ubatch.engine.model.default_model import default_model_path
    from ubatch.engine.model.model import Model
    from ubatch.engine.params import ContextParams
    from ubatch.scoring import kld_vs_top, load_reference, teacher_forced_logprobs

    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-ctk", default="f16")
    ap.add_argument("-ctv", default="f16")
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("--backend", default="auto", help="op backend: auto, cpu, cpu-avx2, cpu-noamx, cpu-portable, torch")
    a = ap.parse_args()
    model = Model.load(a.model or default_model_path())
    ctx = Context(model, ContextParams(n_ctx=1024, n_ubatch=a.ub, type_k=a.ctk, type_v=a.ctv, backend=a.backend))
    print(f"backend {ctx.ops.name}, KV cache K/V = {a.ctk}/{a.ctv}, n_ubatch = {a.ub}")
    print(
        "| text | tokens | ubatch KLD mean | ubatch KLD max | ubatch top-1 | llama.cpp KLD mean (top-32) | llama.cpp top-1 "
        "| <= 1/100 of llama.cpp's | time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    worse = 0
    for t, ref in enumerate(load_reference(REFDATA)):
        ids = ref.ids
        t0 = time.perf_counter()
        lp = teacher_forced_logprobs(ctx, ids)
        dt = time.perf_counter() - t0
        s = kld_vs_top(lp, ref.top_ids, ref.top_logprobs)
        L = ref.lcpp
        ok = s.kld_top_mean <= L["lcpp_kld_top32_mean"] / 100
        worse += not ok
        print(
            f"| {t} | {len(ids)} | {s.kld_top_mean:.2e} | {s.kld_top_max:.2e} | {100 * s.top1_agree:.1f}% | "
            f"{L['lcpp_kld_top32_mean']:.2e} | {100 * L['lcpp_top1_agree']:.1f}% | {'yes' if ok else 'NO'} | {dt:.2f} s |"
        )
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
