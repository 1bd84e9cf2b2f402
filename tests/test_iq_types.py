"""MXFP4, the IQ types and TQ1_0/TQ2_0 in a whole model: a tiny llama whose matrices cycle through
them runs on every CPU build as on the torch reference, and the CLI names the types.

The blocks themselves are checked bit for bit in test_dequant.py (against gguf-py), test_kernels.py
(the C kernels against the reference) and test_triton_matmul.py; scripts/check_quants.py compares
with libggml's own dequantize_row_* and scripts/family_fidelity.py --types IQ4_NL,IQ4_XS runs files
written by llama-quantize against llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_inproc import run_cli
from gguf import GGMLQuantizationType as T
from tiny_models import TinySpec, write_tiny_model

from ubatch.kernels.quant.dequant_iq import KERNELS

# every new type but IQ1_M (its scale is spread over four fields; random bytes make it NaN)
TYPES = (T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ3_S, T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.TQ1_0, T.TQ2_0)


@pytest.fixture(scope="module")
def tiny_iq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers of 7 matrices: the 11 types two or three times each, 256-wide rows (IQ4_XS's block)."""
    spec = TinySpec(
        arch="llama", n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, matrix_types=TYPES, embd_type=T.IQ4_XS
    )
    return write_tiny_model(tmp_path_factory.mktemp("iq") / "tiny-iq.gguf", spec)


def test_every_new_type_is_in_the_file(tiny_iq: Path) -> None:
    from ubatch.engine.gguf.file import open_gguf

    types = {T(t.ggml_type) for t in open_gguf(tiny_iq).tensors.values()}
    assert set(TYPES) <= types and set(TYPES) | {T.IQ1_M} == set(KERNELS)


@pytest.mark.parametrize("backend", ["cpu", "cpu-avx2", "cpu-portable"])
def test_every_cpu_build_runs_the_model_like_the_reference(tiny_iq: Path, backend: str) -> None:
    """Prefill (the GEMM over decoded panels) then decode steps (the GEMV) against the torch backend."""
    from ubatch.engine.batch import Batch
    from ubatch.engine.context.context import Context
    from ubatch.engine.model.model import Model
    from ubatch.engine.params import ContextParams

    model = Model.load(tiny_iq)
    rows = {}
    for name in ("torch", backend):
        ctx = Context(model, ContextParams(n_ctx=256, n_ubatch=32, backend=name))
        ctx.decode(Batch.from_tokens([2] + list(range(10, 50)), 0, all_logits=True))
        got = [ctx.logits.clone()]
        for i in range(3):
            ctx.decode(Batch.from_tokens([60 + i], 41 + i))
            got.append(ctx.logits.clone())
        rows[name] = torch.cat(got).double()
    err = (rows[backend] - rows["torch"]).abs().max() / rows["torch"].abs().max()
    assert err <= (5e-4 if backend == "cpu-avx2" else 1e-4)  # AVX2: x as 16-bit integers (MXFP4, IQ4_*)


def test_info_and_cli_name_the_types(tiny_iq: Path) -> None:
    info = run_cli(["info", "-m", str(tiny_iq), "-c", "256"])
    assert info.returncode == 0, info.stderr
    for t in TYPES:
        assert t.name in info.stdout, t.name
    ran = run_cli(["cli", "-m", str(tiny_iq), "-p", "hello", "-n", "4", "--temp", "0", "-c", "256"])
    assert ran.returncode == 0, ran.stderr
    assert "IQ4_XS" in ran.stderr and "no CPU kernel" not in ran.stderr
