"""`--device` on every command that runs a model: without a GPU, `--device cuda` is one line and
exit 1 before anything loads; llama.cpp's spellings (`-dev none`) run on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_inproc import run_cli

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@pytest.mark.parametrize(
    "args",
    [
        ["cli", "-no-cnv", "-p", "hi", "-n", "1"],
        ["server", "--port", "0"],
        ["bench", "-p", "8", "-n", "0", "-r", "1"],
        ["batched-bench", "-npp", "8", "-ntg", "1", "-npl", "1"],
        ["info"],
        ["explain", "-p", "hi"],
    ],
)
def test_device_cuda_without_a_gpu_is_one_line(args: list[str], tiny_gemma: Path) -> None:
    r = run_cli([*args, "-m", str(tiny_gemma), "--device", "cuda"])
    assert r.returncode == 1 and "no CUDA GPU is visible here" in r.stderr and "--device cpu" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_llama_cpp_device_spellings(tiny_gemma: Path) -> None:
    r = run_cli(["cli", "-m", str(tiny_gemma), "-no-cnv", "-p", "hi", "-n", "2", "--temp", "0", "-dev", "none"])
    assert r.returncode == 0, r.stderr
    bad = run_cli(["cli", "-m", str(tiny_gemma), "-no-cnv", "-p", "hi", "--device", "tpu"])
    assert bad.returncode == 1 and "unknown device" in bad.stderr
