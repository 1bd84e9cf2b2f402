"""What LoRA adapters cost at decode, measured in one run side by side (ratios, not absolutes).

A random rank-R adapter on q, k, v, o, gate, up and down is written as llama.cpp's
convert_lora_to_gguf.py lays one out (general.type = adapter, *.lora_a / *.lora_b), for the model
given (default: the bundled Gemma 3 270M). Then, on one context:

  1 stream:  decode t/s of the base model, and with the adapter applied (target: <= 15% slower);
  8 streams: aggregate decode t/s with all 8 on one adapter, and spread over 4 adapters (each row
             its own adapter in the same ubatch; target: >= 0.8x the single-adapter rate).

Beside them, in the same run where llama.cpp's build is there ($LLAMA_BIN, default
~/.cache/ubatch-yardstick/build/bin): llama-completion's decode t/s on the same model without and
with `--lora` on the same adapter file (its eval time, greedy, --ignore-eos), interleaved too.

    python scripts/bench_lora.py [-m model.gguf] [--rank 16] [-n 64] [--backend cpu] [-t 2]

It prints the load average beside the numbers: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.model.archs import layer_specs
from ubatch.engine.model.default_model import default_model_path
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams

TARGETS = ("wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down")


def write_adapter(model: Model, out: Path, rank: int, seed: int) -> Path:
    """A random F16 LoRA adapter for `model` (alpha = 2 x rank), as the converter writes one."""
    hp, rng = model.hparams, np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), hp.arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(2 * rank))
    for il in range(hp.n_layer):
        for f, spec in layer_specs(hp, il).items():
            if f in TARGETS and spec.name in model.gguf.tensors:
                n_out, n_in = spec.shape
                a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float16)
                b = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float16)
                w.add_tensor(spec.name + ".lora_a", a)
                w.add_tensor(spec.name + ".lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def decode_tps(ctx: Context, sets: list[dict[int, float]], n: int) -> float:
    """Aggregate t/s of len(sets) streams, one token each per decode, stream i applying sets[i]."""
    ctx.memory.clear()
    k = len(sets)
    for s, scales in enumerate(sets):
        ctx.set_seq_adapters(s, scales)
    prompt = [ctx.model.vocab.bos, 100, 200, 300]
    ctx.decode(Batch([t for _ in range(k) for t in prompt], list(range(4)) * k,
                     [[s] for s in range(k) for _ in prompt], [True] * (4 * k)))  # fmt: skip
    tok = 400
    for i in range(2):  # warm the decode graph
        ctx.decode(Batch([tok] * k, [4 + i] * k, [[s] for s in range(k)], [True] * k))
    t0 = time.perf_counter()
    for i in range(n):
        ctx.decode(Batch([tok] * k, [6 + i] * k, [[s] for s in range(k)], [True] * k))
    return k * n / (time.perf_counter() - t0)


LLAMA_BIN = Path(os.environ.get("LLAMA_BIN", Path.home() / ".cache/ubatch-yardstick/build/bin"))


def llama_cpp_tps(model: Path, adapter: Path | None, n: int, threads: int) -> float:
    """llama-completion's decode t/s (its own eval timing) for n greedy tokens, with the adapter if given."""
    cmd = [str(LLAMA_BIN / "llama-completion"), "-m", str(model), "-p", "Once upon a time", "-n", str(n)]
    cmd += ["--temp", "0", "--ignore-eos", "-no-cnv", "-t", str(threads or os.cpu_count() or 1), "-c", "512"]
    cmd += ["--lora", str(adapter)] if adapter else []
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    m = re.search(r"\beval time =.*?([\d.]+) tokens per second", r.stderr.replace("prompt eval time", ""))
    if r.returncode or m is None:
        raise SystemExit(f"llama-completion failed: {r.stderr[-1500:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("-n", type=int, default=64, help="decode steps timed")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs of each case; the best is kept")
    a = ap.parse_args()
    path = a.model or default_model_path()
    model = Model.load(path, a.device)
    tmp = tempfile.TemporaryDirectory()
    files = [write_adapter(model, Path(tmp.name) / f"lora{i}.gguf", a.rank, i) for i in range(4)]
    for f in files:
        model.load_adapter(f)
    params = ContextParams(n_ctx=2048, n_seq_max=8, kv_unified=True, backend=a.backend, n_threads=a.threads)
    ctx = Context(model, params)
    runs: dict[str, list[float]] = {}
    cases = {
        "base1": [{}],
        "one1": [{0: 1.0}],
        "base8": [{}] * 8,
        "one8": [{0: 1.0}] * 8,
        "four8": [{i % 4: 1.0} for i in range(8)],
    }
    llama = (LLAMA_BIN / "llama-completion").exists()
    for _ in range(a.repeat):  # interleaved, best of each: a loaded machine slows runs, never speeds them
        for name, sets in cases.items():
            runs.setdefault(name, []).append(decode_tps(ctx, sets, a.n))
        if llama:
            runs.setdefault("llama_base", []).append(llama_cpp_tps(path, None, a.n, a.threads))
            runs.setdefault("llama_one", []).append(llama_cpp_tps(path, files[0], a.n, a.threads))
    tmp.cleanup()
    base1, one1, base8, one8, four8 = (max(runs[k]) for k in cases)
    load = os.getloadavg()
    print(
        f"model {path.name}, rank {a.rank}, backend {a.backend}, {a.n} decode steps, best of {a.repeat}, load average {load[0]:.2f}"
    )
    print(f"1 stream:  base {base1:8.1f} t/s  one adapter {one1:8.1f} t/s  cost {100 * (base1 / one1 - 1):5.1f}%")
    print(f"8 streams: base {base8:8.1f} t/s  one adapter {one8:8.1f} t/s  four adapters {four8:8.1f} t/s  "
          f"four/one = {four8 / one8:.2f}x")  # fmt: skip
    if llama:
        lb, lo = max(runs["llama_base"]), max(runs["llama_one"])
        print(
            f"llama.cpp llama-completion, 1 stream: base {lb:8.1f} t/s  --lora {lo:8.1f} t/s  cost {100 * (lb / lo - 1):5.1f}%"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
