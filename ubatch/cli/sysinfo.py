"""Who ran a benchmark, on what: the model, build and CPU strings llama-bench records.

llama-bench writes these into every result row (`model_type`, `build_commit`, `cpu_info`) so
that numbers from different machines and versions can be told apart; they are computed once
per process.
"""

from __future__ import annotations

import functools
import subprocess
from collections import defaultdict
from pathlib import Path

from ubatch.engine.model.model import Model
from ubatch.kernels.cpu.build import cpu_model

# llama_model_ftype_name for the file types a GGUF header names
FTYPE_NAMES = {
    0: "all F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K - Medium",
    11: "Q3_K - Small",
    12: "Q3_K - Medium",
    13: "Q3_K - Large",
    14: "Q4_K - Small",
    15: "Q4_K - Medium",
    16: "Q5_K - Small",
    17: "Q5_K - Medium",
    18: "Q6_K",
    19: "IQ2_XXS - 2.0625 bpw",
    20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small",
    22: "IQ3_XS - 3.3 bpw",
    23: "IQ3_XXS - 3.0625 bpw",
    24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw",
    26: "IQ3_S - 3.4375 bpw",
    27: "IQ3_S mix - 3.66 bpw",
    28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw",
    30: "IQ4_XS - 4.25 bpw",
    31: "IQ1_M - 1.75 bpw",
    32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary",
    37: "TQ2_0 - 2.06 bpw ternary",
    38: "MXFP4 MoE",
}


def model_description(model: Model) -> str:
    """llama_model_desc: '<arch> <size> <file type>', e.g. 'gemma3 270M Q4_K - Medium'."""
    md = model.gguf.metadata
    size = md.get("general.size_label")
    if not size:
        n = model.n_params
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
    ft = md.get("general.file_type")
    if isinstance(ft, int | float | str):  # a scalar, as GGUF stores it
        ftype = FTYPE_NAMES.get(int(ft), f"ftype {int(ft)}")
    else:  # llama.cpp guesses from the most common matrix type
        from gguf import GGMLQuantizationType as T

        counts: dict[int, int] = defaultdict(int)
        for w in model.matrices():
            counts[w.ggml_type] += 1
        ftype = T(max(counts, key=lambda k: counts[k])).name + " (guessed)"
    return f"{model.hparams.arch} {size} {ftype}"


@functools.lru_cache(maxsize=1)
def build_info() -> tuple[str, int]:
    """(build_commit, build_number): ubatch's version, with the git commit when run from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("ubatch")
    except PackageNotFoundError:
        v = "unknown"
    try:
        r = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if r.returncode == 0 and r.stdout.strip():
            v += "+g" + r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v, 0


@functools.lru_cache(maxsize=1)
def cpu_info() -> str:
    """The CPU's model name, as llama-bench's cpu_info column."""
    return cpu_model()


__all__ = ["FTYPE_NAMES", "model_description", "build_info", "cpu_info"]
