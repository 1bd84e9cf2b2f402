"""ubatch against llama.cpp on this CPU, side by side in one run: the native builds, then the AVX2 ones.

    python scripts/bench_cpu.py [--llama-bin DIR] [--llama-bin-avx2 DIR] [--isa native,avx2]
                                [-m MODEL] [-t THREADS] [-r 3] [--npl 1,2,4,8,16]

Builds nothing. DIR holds llama.cpp's llama-bench, llama-batched-bench and llama-completion:
- native: llama.cpp built for this CPU (`../shared/tools/llama-cpp.sh`; default $LLAMA_BIN or
  ~/.cache/ubatch-yardstick/build/bin) against ubatch's `cpu` backend;
- avx2: llama.cpp restricted to AVX2/FMA/F16C (`LLAMA_CPP_ISA=avx2 ../shared/tools/llama-cpp.sh`;
  default $LLAMA_BIN_AVX2 or ~/.cache/ubatch-yardstick/build-avx2/bin) against `--backend
  cpu-avx2` (ubatch's 256-bit kernels, even on an AVX-512 CPU). Most desktops have AVX2 and no
  AVX-512, so this is the comparison that holds for them.
Each measurement runs ubatch and llama.cpp one after the other on the same model, threads and
flags, alternating over -r rounds so that load elsewhere on the machine hits both alike:
- pp512 and tg128 t/s (llama-bench vs `ubatch bench`) and their ratio; for tg the weight bytes a
  token streams (every matrix as the kernels read it once per decode: as stored for llama.cpp,
  with ubatch's repacks for ubatch) times t/s, i.e. achieved GB/s;
- aggregate decode S_TG at each -npl (llama-batched-bench vs `ubatch batched-bench`, -npp 64
  -ntg 32), one stream count a run, the two sides in turn;
- (native only) peak RSS of a 16-token completion at -c 4096 (llama-completion vs `ubatch cli`).
If llama.cpp's repacked weights (its AMX or interleaved-block kernels) kill it on this CPU, as
its AMX path does with SIGILL on some virtual machines, every llama.cpp tool runs with repacking
off (`--repack 0` / `-nr`), and the header says so.
The CPU model, its SIMD flags and the kernel path ubatch took are printed with each table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ubatch.cli.bench.batched import BatchedParams, run_batched_bench
from ubatch.cli.bench.params import BenchParams
from ubatch.cli.bench.run import repack_bytes, run_bench
from ubatch.engine.context.context import make_backend
from ubatch.engine.model.default_model import default_model_path
from ubatch.engine.model.model import Model
from ubatch.kernels.cpu.build import cpu_flags, cpu_model, load

PROMPT = "The history of the printing press begins"


def llama_repack(bin_dir: Path, model: Path, threads: int) -> tuple[bool, str]:
    """Probe llama-bench once: (whether llama.cpp must run with repacking off, a header line).
    Off only where it fails with repacking on (by a signal, or any error exit) and runs with it
    off; where it fails both ways the script stops with llama-bench's last line."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "16", "-n", "0", "-r", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        return False, "llama.cpp: default weight repacking"
    how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit status {r.returncode}"
    off = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True)
    if off.returncode != 0:
        last = (off.stderr.strip().splitlines() or r.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"llama-bench fails ({how}), with and without --repack 0: {last}")
    return (
        True,
        f"llama.cpp: repacked weights (AMX / interleaved kernels) fail with {how} here; measured with --repack 0 / -nr",
    )


def llama_bench(bin_dir: Path, model: Path, threads: int, reps: int, no_repack: bool) -> dict[str, float]:
    out = subprocess.run(
        [
            str(bin_dir / "llama-bench"),
            *(["--repack", "0"] if no_repack else []),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-p",
            "512",
            "-n",
            "128",
            "-r",
            str(reps),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in json.loads(out)}


def ubatch_bench(model: Model, threads: int, reps: int, backend: str = "auto") -> dict[str, float]:
    p = BenchParams(models=[model.path], n_threads=[threads], reps=reps, backend=backend)
    return {r.test: r.avg_ts for r in run_bench(p, models={model.path: model})}


def llama_batched(bin_dir: Path, model: Path, threads: int, npl: list[int], no_repack: bool) -> dict[int, float]:
    out = subprocess.run(
        [
            str(bin_dir / "llama-batched-bench"),
            *(["-nr"] if no_repack else []),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-c",
            "4096",
            "-npp",
            "64",
            "-ntg",
            "32",
            "-npl",
            ",".join(map(str, npl)),
            "--output-format",
            "jsonl",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return {r["pl"]: r["speed_tg"] for r in rows}


def ubatch_batched(model: Model, threads: int, npl: list[int], backend: str = "auto") -> dict[int, float]:
    p = BatchedParams(model=model.path, n_ctx=4096, n_threads=threads, n_pp=[64], n_tg=[32], n_pl=npl, backend=backend)
    _, rows = run_batched_bench(p, model=model)
    return {r.pl: r.speed_tg for r in rows}


# A tiny launcher (no torch, ~10 MB) forks the measured command: a child forked from this
# script would inherit this process's RSS in its ru_maxrss before exec.
_LAUNCH = (
    "import os,sys\npid=os.fork()\nif pid==0:\n    os.execvp(sys.argv[1],sys.argv[1:])\n"
    "_,st,ru=os.wait4(pid,0)\nprint(ru.ru_maxrss)\nsys.exit(os.waitstatus_to_exitcode(st))"
)


def peak_rss_mib(cmd: list[str]) -> float:
    """Peak RSS of a command, from wait4's rusage (kilobytes on Linux)."""
    r = subprocess.run([sys.executable, "-S", "-c", _LAUNCH, *cmd], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}: {r.stderr.strip()[-300:]}")
    return int(r.stdout.strip().splitlines()[-1]) / 1024


@dataclass(frozen=True, slots=True)
class Side:
    """One comparison: a llama.cpp build and the ubatch backend that matches its instruction set."""

    isa: str  # "native" or "avx2"
    bin_dir: Path
    backend: str  # ubatch's --backend


def compare(side: Side, model: Model, path: Path, threads: int, reps: int, npl: list[int]) -> None:
    """pp512/tg128 and batched S_TG of one side, alternating ubatch and llama.cpp, as tables."""
    lib = load(no_avx512=side.backend == "cpu-avx2")
    simd = sorted(
        f
        for f in cpu_flags()
        if re.fullmatch(r"avx2|fma|f16c|avx512(f|bw|vl|_bf16|_fp16|_vnni|vnni)|amx_(bf16|int8)", f)
    )
    tiles = " + AMX tiles (prefill GEMM)" if lib.amx else ""
    built = "built for this CPU" if side.isa == "native" else "restricted to AVX2/FMA/F16C"
    print(
        f"\n## {side.isa}: ubatch --backend {side.backend} against llama.cpp {built} ({side.bin_dir})\n\n"
        f"CPU: {cpu_model()} ({os.cpu_count()} CPUs; {' '.join(simd)}), threads {threads}; "
        f"ubatch kernels: C {lib.simd}{tiles}; model {path.name}"
    )
    no_repack, line = llama_repack(side.bin_dir, path, threads)
    print(line)

    lc: dict[str, list[float]] = {"pp512": [], "tg128": []}
    ub: dict[str, list[float]] = {"pp512": [], "tg128": []}
    for _ in range(reps):  # alternate, one rep each, so drift hits both
        for k, v in llama_bench(side.bin_dir, path, threads, 1, no_repack).items():
            lc[k].append(v)
        for k, v in ubatch_bench(model, threads, 1, side.backend).items():
            ub[k].append(v)
    weight_bytes = model.active_bytes  # a mixture of experts: the experts a token chooses
    ops = make_backend(side.backend, threads)  # what ubatch's kernels read: its repacks included
    ops.prepare_weights(model.matrices())
    ub_bytes = weight_bytes + repack_bytes(ops)
    print("\n| test | ubatch t/s | llama.cpp t/s | ratio | ubatch GB/s | llama.cpp GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in ("pp512", "tg128"):
        u, lv = max(ub[k]), max(lc[k])
        gb = f"{ub_bytes * u / 1e9:.1f} | {weight_bytes * lv / 1e9:.1f}" if k == "tg128" else "- | -"
        print(f"| {k} | {u:.1f} | {lv:.1f} | {u / lv:.2f}x | {gb} |")
    moe = model.hparams.moe
    active = f" (the active weights: {moe.n_expert_used} of {moe.n_expert} experts)" if moe else ""
    print(
        f"(best of {reps}; a tg token streams {weight_bytes / 2**20:.0f} MiB of stored weights{active} in llama.cpp, "
        f"{ub_bytes / 2**20:.0f} MiB with ubatch's repacks)"
    )

    lb: dict[int, float] = {}
    ubb: dict[int, float] = {}
    # one stream count at a time (-npl N: n_seq_max = N on both sides), the two sides in turn and
    # in alternating order, so each pair of runs is seconds apart; each side keeps its best
    for n in npl:
        for i in range(reps):
            for who in ("llama", "ubatch") if i % 2 == 0 else ("ubatch", "llama"):
                if who == "llama":
                    best, got = lb, llama_batched(side.bin_dir, path, threads, [n], no_repack)
                else:
                    best, got = ubb, ubatch_batched(model, threads, [n], side.backend)
                for pl, v in got.items():
                    best[pl] = max(best.get(pl, 0.0), v)
    print("\n| streams | ubatch S_TG t/s | llama.cpp S_TG t/s | ratio |")
    print("|---:|---:|---:|---:|")
    for n in npl:
        print(f"| {n} | {ubb[n]:.1f} | {lb[n]:.1f} | {ubb[n] / lb[n]:.2f}x |")
    print(f"(best of {reps} runs each, one stream count a run, -npp 64 -ntg 32 -c 4096)")


def peak_rss(bin_dir: Path, path: Path, threads: int) -> None:
    """The same completion for both: 16 greedy tokens at -c 4096."""
    no_repack, _ = llama_repack(bin_dir, path, threads)
    args = ["-m", str(path), "-c", "4096", "-n", "16", "--temp", "0", "-p", PROMPT, "-t", str(threads)]
    cli = [sys.executable, "-m", "ubatch.cli.main", "cli", *args]
    lcc = [str(bin_dir / "llama-completion"), *args, "-no-cnv", *(["-nr"] if no_repack else [])]
    ru, rl = peak_rss_mib(cli), peak_rss_mib(lcc)
    print(
        f"\npeak RSS, 16-token completion at -c 4096: ubatch {ru:.0f} MiB, llama-completion {rl:.0f} MiB (difference {ru - rl:+.0f} MiB)"
    )


def main() -> None:
    cache = Path.home() / ".cache/ubatch-yardstick"
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(cache / "build/bin")))
    ap.add_argument("--llama-bin-avx2", default=os.environ.get("LLAMA_BIN_AVX2", str(cache / "build-avx2/bin")))
    ap.add_argument("--isa", default="native,avx2", help="the comparisons to run: native, avx2 or both")
    ap.add_argument("-m", "--model")
    ap.add_argument("-t", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--npl", default="1,2,4,8,16")
    a = ap.parse_args()
    isas = [x.strip() for x in a.isa.split(",") if x.strip()]
    if not isas or any(x not in ("native", "avx2") for x in isas):
        sys.exit(f"--isa {a.isa!r}: use native, avx2 or native,avx2")
    sides = [
        Side("native", Path(a.llama_bin), "cpu") if x == "native" else Side("avx2", Path(a.llama_bin_avx2), "cpu-avx2")
        for x in isas
    ]
    for side in sides:
        if not (side.bin_dir / "llama-bench").exists():
            how = (
                "../shared/tools/llama-cpp.sh"
                if side.isa == "native"
                else "LLAMA_CPP_ISA=avx2 ../shared/tools/llama-cpp.sh"
            )
            flag = "--llama-bin" if side.isa == "native" else "--llama-bin-avx2"
            sys.exit(f"{side.bin_dir}: no llama-bench; build it with {how} or pass {flag}")
    path = Path(a.model) if a.model else default_model_path()
    model = Model.load(path)
    npl = [int(x) for x in a.npl.split(",")]
    for side in sides:
        compare(side, model, path, a.t, a.r, npl)
    if sides[0].isa == "native":
        peak_rss(sides[0].bin_dir, path, a.t)


if __name__ == "__main__":
    main()
