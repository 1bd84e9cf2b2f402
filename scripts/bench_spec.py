"""Speculative decoding on this CPU: what n-gram drafts buy on a repetitive task, and what -ub
below the verification rows takes back; llama-server alongside when its binary is there.

    python scripts/bench_spec.py [-m MODEL] [--llama-bin DIR] [-n 128] [-r 3] [-t THREADS]

1. Rewriting a code block (greedy): generated tokens/s without speculation and with
   `--spec-type ngram-simple` (llama.cpp's defaults, size-n 12 / size-m 48, and a short lookup,
   size-n 3); the acceptance and the tokens per decode call. The greedy text is checked equal.
2. The essay's claim: 5-token drafts (ngram-simple, size-m 5, --spec-draft-n-min 5, so every
   verification is 1 + 5 = 6 rows) at -ub 512 and at -ub 4: forward passes per verification
   (1 vs 2), milliseconds per verification decode, per token a verification keeps (the accepted
   drafts plus the target's own) and per generated token overall.
3. With --llama-bin: llama-server with and without `--spec-type ngram-simple` on the same prompt
   (its own `timings`: predicted_per_second, draft_n, draft_n_accepted), so the ratios are one run.
The CPU model is printed with the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from ubatch.engine.completion.complete import CompletionStats, complete
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.model.default_model import default_model_path
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.spec.draft import create_speculator
from ubatch.engine.spec.speculative import SpecParams
from ubatch.kernels.cpu.build import cpu_model

CODE = '''def parse_header(line: str) -> tuple[str, str]:
    """Split an HTTP header line into its name and value."""
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def read_headers(lines: list[str]) -> dict[str, str]:
    headers = {}
    for line in lines:
        if not line.strip():
            break
        name, value = parse_header(line)
        headers[name] = value
    return headers
'''
PROMPT = f"Here is a Python module:\n\n{CODE}\nThe same module, rewritten without any change:\n\n"


def run(model: Model, n: int, ub: int, threads: int, spec: SpecParams | None) -> tuple[list[int], CompletionStats]:
    n_out = spec.n_outputs_max(1, 1) if spec is not None else 1
    ctx = Context(model, ContextParams(n_ctx=2048, n_ubatch=ub, n_threads=threads, n_outputs_max=n_out))
    ctx.warmup()
    sp = create_speculator(spec, ctx) if spec is not None else None
    st = CompletionStats()
    ids = model.vocab.tokenize(PROMPT, add_special=True)
    sampler = Sampler(SamplerParams(temp=0))
    toks = [
        e.token
        for e in complete(ctx, ids, sampler, GenerationParams(n_predict=n, ignore_eos=True), st, speculator=sp)
        if e.token >= 0
    ]
    return toks, st


def best(model: Model, n: int, ub: int, threads: int, spec: SpecParams | None, reps: int) -> dict[str, Any]:
    runs = [run(model, n, ub, threads, spec) for _ in range(reps)]
    toks, st = max(runs, key=lambda r: r[1].n_eval / max(r[1].t_eval_ms, 1e-9))
    tps = [r[1].n_eval / (r[1].t_eval_ms / 1e3) for r in runs]
    s = st.spec
    return {
        "tokens": toks,
        "tg_tps": max(tps),
        "tg_tps_median": statistics.median(tps),
        "calls": st.n_eval_calls,
        "n_eval": st.n_eval,
        "drafts": s.n_drafts,
        "drafted": s.n_drafted,
        "accepted": s.n_accepted,
        "passes": s.n_verify_ubatches,
        "ms_per_token": st.t_eval_ms / max(st.n_eval, 1),
        "ms_per_verification": s.t_verify_ms / max(s.n_drafts, 1),
        "ms_per_accepted": s.t_verify_ms / max(s.n_accepted + s.n_drafts, 1),  # tokens a verification yields
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server(bin_dir: Path, model: Path, n: int, threads: int, extra: list[str]) -> dict[str, Any]:
    port = free_port()
    cmd = [
        str(bin_dir / "llama-server"),
        "-m",
        str(model),
        "-c",
        "2048",
        "-np",
        "1",
        "--port",
        str(port),
        "-t",
        str(threads),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if json.load(urllib.request.urlopen(url + "/health", timeout=1)).get("status") == "ok":
                    break
            except OSError:
                time.sleep(0.1)
        body = {"prompt": PROMPT, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        req = urllib.request.Request(
            url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        out = json.load(urllib.request.urlopen(req, timeout=600))
        return out["timings"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument(
        "--llama-bin",
        type=Path,
        default=Path(os.environ.get("LLAMA_BIN", Path.home() / ".cache/ubatch-yardstick/build/bin")),
    )
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    path = a.model or default_model_path()
    model = Model.load(path)
    print(f"CPU: {cpu_model()}, {a.threads} threads; model {path.name}; greedy, {a.n} tokens, best of {a.reps}")

    print("\n1. rewriting a code block: ngram-simple drafts vs none (-ub 512)")
    rows = [
        ("none", None),
        ("ngram-simple 12/48", SpecParams(types=("ngram-simple",))),
        ("ngram-simple 3/48", SpecParams(types=("ngram-simple",), ngram_size_n=3)),
    ]
    base = None
    print(f"{'drafts':<20} {'tg t/s':>8} {'x plain':>8} {'calls':>6} {'tok/call':>8} {'accepted':>14} {'same text':>9}")
    for name, spec in rows:
        r = best(model, a.n, 512, a.threads, spec, a.reps)
        base = base or r
        acc = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
        print(
            f"{name:<20} {r['tg_tps']:8.2f} {r['tg_tps'] / base['tg_tps']:8.2f} {r['calls']:6d} "
            f"{r['n_eval'] / max(r['calls'], 1):8.2f} {acc:>14} {str(r['tokens'] == base['tokens']):>9}"
        )

    print("\n2. 5-token drafts (1 + 5 = 6 rows per verification) at -ub 512 and -ub 4")
    five = SpecParams(types=("ngram-simple",), ngram_size_n=3, ngram_size_m=5, n_min=5)
    print(
        f"{'-ub':>5} {'verifications':>13} {'passes/verif':>12} {'ms/verif':>9} {'ms/tok kept':>11} {'ms/token':>9} {'tg t/s':>8}"
    )
    for ub in (512, 4):
        r = best(model, a.n, ub, a.threads, five, a.reps)
        print(
            f"{ub:5d} {r['drafts']:13d} {r['passes'] / max(r['drafts'], 1):12.2f} {r['ms_per_verification']:9.2f} "
            f"{r['ms_per_accepted']:11.2f} {r['ms_per_token']:9.2f} {r['tg_tps']:8.2f}"
        )

    if (a.llama_bin / "llama-server").exists():
        print("\n3. llama-server on the same prompt (its own timings)")
        plain = llama_server(a.llama_bin, path, a.n, a.threads, [])
        ngram = llama_server(a.llama_bin, path, a.n, a.threads, ["--spec-type", "ngram-simple"])
        for name, t in (("none", plain), ("ngram-simple 12/48", ngram)):
            acc = f"{t.get('draft_n_accepted', 0)}/{t.get('draft_n', 0)}" if t.get("draft_n") else "-"
            print(f"llama-server {name:<20} {t['predicted_per_second']:8.2f} t/s  drafts accepted {acc}")


if __name__ == "__main__":
    main()
