"""The Triton quantised matmul (kernels/cuda/triton/matmul.py) against dequantise-then-matmul.

Without a GPU the kernels run in Triton's interpreter on the CPU (tiny shapes: the grid is a
handful of programs); with one, compiled on it (tests/triton_interp.py). They are also compiled for sm_90 by scripts/triton_compile_check.py in a subprocess that
uses the real compiler. Tolerance: max |out - ref| / max |ref| <= 1e-5 against a float64
reference of the exactly dequantised weights (kernels/quant/dequant.py); the kernels accumulate in f32.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from triton_interp import DEVICE  # first: interpreter mode without a GPU

import ubatch.kernels.cuda.triton.matmul as mm
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.weight import QWeight

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import triton_matmul_bench as bench  # noqa: E402  (random valid blocks; the device benchmark)

REL_TOL = 1e-5
# K per type: an odd number of blocks (3 x 32, 3 x 256) and an odd float width; N = 21 leaves a
# partial tile of weight rows in every kernel
COLS = {T.F32: 37, T.F16: 37, T.BF16: 37} | {t: 768 for t in T if GGML_QUANT_SIZES.get(t, (0,))[0] == 256}
N_ROWS = 21
ROWS = (
    1,
    3,
    16,
    17,
    130,
)  # GEMV at 1 (reduce), 3 and 16 (rows padded to 16, tl.dot); tiled beyond, 130 spans two row tiles


def check(w: QWeight, m: int, seed: int = 1) -> float:
    """Run linear on m random rows and return its max error relative to the reference's max."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, w.shape[1], generator=g)
    out = torch.full((m, w.shape[0]), float("nan"), device=DEVICE)
    assert mm.linear(x.to(DEVICE), w, out) is out
    ref = x.double() @ dequantize(w.raw.cpu(), w.ggml_type, w.shape).double().T
    return float((out.cpu().double() - ref).abs().max() / ref.abs().max())


# fmt: off
TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K,
         T.MXFP4, T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M,
         T.TQ1_0, T.TQ2_0]
# fmt: on


def test_supported_is_every_type_tested() -> None:
    assert mm.SUPPORTED == frozenset(int(t) for t in TYPES)


# every row count for one plain and one K-quant type; the others at the edges of the three kernel
# paths (the interpreter is slow, and 3 / 130 rows take the same code as 16 / 17)
FULL = {T.Q8_0, T.Q4_K, T.MXFP4}  # MXFP4: odd 17-byte blocks, rows at odd offsets
CASES = [(t, m) for t in TYPES for m in ROWS if t in FULL or m in (1, 16, 17)]


@pytest.mark.parametrize("t, m", CASES, ids=[f"{t.name}-{m}" for t, m in CASES])
def test_linear_matches_dequantised_matmul(t: T, m: int) -> None:
    w = bench.random_weight(t, N_ROWS, COLS.get(t, 96), DEVICE)
    assert check(w, m) <= REL_TOL


def test_strided_rows_of_x_and_out() -> None:
    """x and out may be row views of larger buffers (the workspace): only the rows are contiguous."""
    w = bench.random_weight(T.Q8_0, N_ROWS, 64, DEVICE)
    for m in (2, 20):
        xbuf, obuf = torch.randn(m, 100, device=DEVICE), torch.zeros(m, 50, device=DEVICE)
        x, out = xbuf[:, 3:67], obuf[:, 5 : 5 + N_ROWS]
        mm.linear(x, w, out)
        ref = x.cpu() @ w.to("cpu").dense().T
        assert float((out.cpu() - ref).abs().max() / ref.abs().max()) <= REL_TOL
        assert not obuf[:, :5].any() and not obuf[:, 5 + N_ROWS :].any()  # nothing outside out written


@pytest.mark.parametrize("t", [T.Q2_K, T.Q3_K, T.NVFP4], ids=lambda t: t.name)
def test_unsupported_type_is_refused(t: T) -> None:
    block, type_size = GGML_QUANT_SIZES[t]
    w = QWeight("blk.0.ffn_up.weight", torch.zeros(4 * type_size, dtype=torch.uint8), int(t), (4, block))
    with pytest.raises(NotImplementedError, match=f"no Triton matmul kernel for {t.name}.*blk.0.ffn_up"):
        mm.linear(torch.zeros(1, block), w, torch.zeros(1, 4))


def test_bad_shapes_are_refused() -> None:
    w = bench.random_weight(T.Q4_0, 8, 64, DEVICE)
    with pytest.raises(ValueError, match="linear"):
        mm.linear(torch.zeros(1, 32), w, torch.zeros(1, 8))
    with pytest.raises(ValueError, match="even offset"):
        odd = QWeight("w", torch.zeros(8 * 36 + 1, dtype=torch.uint8)[1:], int(T.Q4_0), (8, 64))
        mm.linear(torch.zeros(1, 64), odd, torch.zeros(1, 8))


@pytest.fixture(scope="module")
def default_gguf(default_model_path: Path):  # type: ignore[no-untyped-def]
    from ubatch.engine.gguf.file import open_gguf

    return open_gguf(default_model_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.0.attn_q.weight", "token_embd.weight"]
)
def test_real_tensor_rows(default_gguf, name: str) -> None:  # type: ignore[no-untyped-def]
    """The first rows of real tensors of the default model (Q4_K, Q6_K, Q5_0, Q8_0)."""
    t = default_gguf.tensors[name]
    k = t.shape[-1]
    raw = torch.from_numpy(t.data[: N_ROWS * t.data.size // t.shape[0]].copy())
    w = QWeight(name, raw.to(DEVICE), t.ggml_type, (N_ROWS, k))
    for m in (1, 17):
        assert check(w, m) <= REL_TOL


def test_bench_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/triton_matmul_bench.py works before a device is lent: every kernel it times, with
    the block sizes it sweeps, agrees with the reference."""
    assert bench.main(["--dry-run", "--types", "Q4_K", "--sweep"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if " err " in ln]
    sweeps = len(bench.GEMV1_SWEEP) + len(bench.GEMV16_SWEEP) + len(bench.TILED_SWEEP)
    assert len(rows) == 3 + sweeps
    assert all(float(ln.rsplit("err ", 1)[1]) <= REL_TOL for ln in rows), rows


def test_compile_for_sm90_subset() -> None:
    """A representative subset of COMPILE_SPECS compiles for sm_90 with the real compiler (the
    script compiles all of them): the gathers of each block family, both kernels, both extremes
    of BLOCK_M, each also as the JIT specialises it for aligned arguments."""
    subset = ["gemv[Q4_K,m1,", "gemv[Q5_0,m16,", "tiled[Q6_K,", "tiled[BF16,", "lora[fp16,M1,R16]"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(ROOT / "scripts" / "triton_compile_check.py"), "--jobs", "2", "--aligned"]
    r = subprocess.run(
        cmd + [a for s in subset for a in ("--match", s)], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("OK ")]
    assert len(lines) == 2 * len(subset) and all("regs=" in ln for ln in lines), r.stdout
