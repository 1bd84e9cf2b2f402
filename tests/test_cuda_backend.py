"""The `cuda` backend end to end on the CPU: the Triton kernels run by Triton's interpreter on
CPU tensors, against the torch reference backend on tiny llama and gemma3 models (gemma3:
sliding-window and global layers, post-norms fused with the residual add, logit softcap).

Greedy tokens must be equal; logits within 1e-4 of the largest reference logit with an f16
cache (f32 math in other orders: tiled matmuls, online softmax), 1e-3 with a q8_0 cache (a K/V
value a hair from a rounding boundary can land on the other 8-bit code). The interpreter runs
the quantised matmul at ~0.1 s per program, so most tests here multiply with
dequantise-then-matmul (`reference_matmul`) and one runs the real Triton matmul on a one-layer
model; the matmul kernels themselves are tested in tests/test_triton_matmul.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton_interp  # noqa: F401  (interpreter mode before any kernel module is imported)
from test_kernels import rel_err
from tiny_models import TinySpec, write_tiny_model

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.kernels import backends

PROMPT = [2, 17, 33, 5, 60, 41, 9, 70, 12, 88]


class ReferenceMatmul:
    """Stands in for kernels/cuda/triton/matmul.py: every type 'has a kernel', computed as x @ dense(w)ᵀ."""

    SUPPORTED = frozenset(range(64))
    GEMV_MAX_ROWS = 16

    @staticmethod
    def linear(x: torch.Tensor, w, out: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return torch.mm(x, w.dense().t(), out=out)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    d: Path = tmp_path_factory.mktemp("cuda")
    specs = {
        "llama": TinySpec(arch="llama", n_layer=2),
        "gemma3": TinySpec(n_layer=2),  # layer 0 sliding-window (n_swa 8), layer 1 global
        "gemma3-1": TinySpec(n_layer=1),
    }
    return {k: Model.load(write_tiny_model(d / f"{k}.gguf", s)) for k, s in specs.items()}


def cuda_ops(triton_matmul: bool = False):  # type: ignore[no-untyped-def]
    ops = backends.create("cuda")
    if not triton_matmul:
        ops._mm = ReferenceMatmul
    return ops


def greedy(
    ctx: Context, prompt: list[int], steps: int, forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Prefill (every row an output), then `steps` one-token decodes of the argmax (or of
    `forced`, so both backends decode the same tokens even if one picked differently)."""
    ctx.decode(Batch.from_tokens(prompt, 0, all_logits=True))
    rows, toks = [ctx.logits.clone()], []
    for i in range(steps):
        toks.append(int(ctx.logits[-1].argmax()))
        ctx.decode(Batch.from_tokens([forced[i] if forced else toks[-1]], len(prompt) + i))
        rows.append(ctx.logits.clone())
    return toks, torch.cat(rows)


@pytest.mark.parametrize("arch, kv", [("llama", "f16"), ("gemma3", "q8_0")])
def test_greedy_tokens_and_logits_equal_the_torch_backend(models, arch: str, kv: str) -> None:
    model = models[arch]
    params = ContextParams(n_ctx=256, n_ubatch=8, type_k=kv, type_v=kv)  # the prompt takes 2 ubatches
    want_toks, want = greedy(Context(model, params, backends.create("torch")), PROMPT, 4)
    ops = cuda_ops()
    toks, got = greedy(Context(model, params, ops), PROMPT, 4, want_toks)
    assert toks == want_toks
    assert rel_err(got, want) <= (1e-4 if kv == "f16" else 1e-3)
    assert ops.held_bytes() == 0
    # gemma's two post-norms per layer ran inside the residual adds (in every graph bound)
    assert (ops.fused > 0) == (arch == "gemma3")


def test_the_triton_matmul_in_the_whole_model(models) -> None:
    model, params = models["gemma3-1"], ContextParams(n_ctx=256, n_ubatch=8)
    want_toks, want = greedy(Context(model, params, backends.create("torch")), PROMPT[:3], 2)
    toks, got = greedy(Context(model, params, cuda_ops(triton_matmul=True)), PROMPT[:3], 2, want_toks)
    assert toks == want_toks
    assert rel_err(got, want) <= 1e-4


def test_two_sequences_in_one_batch_read_their_own_streams(models) -> None:
    """-np 2: split_equal puts both sequences in one ubatch, one KV stream (group) each."""
    params = ContextParams(n_ctx=512, n_ubatch=16, n_seq_max=2, type_k="q8_0", type_v="f16")
    out = {}
    for name in ("torch", "cuda"):
        ctx = Context(models["gemma3"], params, cuda_ops() if name == "cuda" else backends.create(name))
        ctx.decode(Batch(PROMPT[:6] + PROMPT[4:], list(range(6)) * 2, [[0]] * 6 + [[1]] * 6, [True] * 12))
        first = ctx.logits.clone()
        ctx.decode(Batch([7, 8], [6, 6], [[0], [1]], [True, True]))
        out[name] = torch.cat([first, ctx.logits.clone()])
    assert rel_err(out["cuda"], out["torch"]) <= 1e-3


def test_a_type_without_a_triton_kernel_is_dequantised_with_one_notice(models) -> None:
    from ubatch.kernels.quant.dequant import type_name
    from ubatch.kernels.quant.weight import QWeight

    ops = backends.create("cuda")
    w = models["llama"].layers[0].wq
    ops._mm = type("NoKernels", (), {"SUPPORTED": frozenset(), "GEMV_MAX_ROWS": 16})
    other = QWeight("other", w.raw, w.ggml_type, w.shape)
    ops.prepare_weights([w, other])
    notices = [n for n in ops.notices if "no Triton matmul kernel" in n]
    assert notices == [
        f"{type_name(w.ggml_type)} has no Triton matmul kernel: those tensors are dequantised on the device at each use (slower)"
    ]
    x = torch.randn(3, w.shape[1])
    assert rel_err(ops.linear(x, w, torch.empty(3, w.shape[0])), x @ w.dense().t()) <= 1e-6
    assert ops.kernel_path(w.ggml_type).startswith("dequantise per use")


def test_without_a_gpu_or_the_interpreter_the_backend_says_why(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(backends.BackendError, match="cannot run here: no CUDA GPU"):
        backends.create("cuda")


class _Recorded:
    """Stands in for a captured CUDA graph on the CPU: replay runs the recorded steps."""

    def __init__(self, steps: list) -> None:
        self.steps = steps

    def replay(self) -> None:
        for s in self.steps:
            s()


def test_graph_runner_runs_eagerly_then_captures_then_replays(models, monkeypatch) -> None:
    """The runner's bookkeeping, with a stand-in for CUDA graph capture: the first sight of a
    shape runs eagerly, the second is captured, then replayed; a ubatch over GRAPH_MAX_TOKENS
    rows is never captured. Replays must give the reference's logits."""
    from ubatch.engine.graph import cuda_graphs
    from ubatch.kernels.cuda import graphs
    from ubatch.kernels.torch_ops import TorchOps

    assert TorchOps().graph_runner is None  # CPU backends: plain run_graph
    ops = cuda_ops()
    assert ops.graph_runner is None  # the interpreter: no CUDA graphs
    ops.cuda_graphs = True
    monkeypatch.setattr(graphs.CudaGraphRunner, "capture", staticmethod(_Recorded))
    monkeypatch.setattr(graphs, "GRAPH_MAX_TOKENS", 4)
    model, params, prompt = models["llama"], ContextParams(n_ctx=256, n_ubatch=8), PROMPT[:6]  # 6 rows: eager
    want_toks, want = greedy(Context(model, params, backends.create("torch")), prompt, 4)
    toks, got = greedy(Context(model, params, ops), prompt, 4, want_toks)
    c = cuda_graphs.counters(ops)
    assert (c.eager, c.captures, c.replays) == (2, 1, 3)  # the prefill and the first decode eager
    assert toks == want_toks and rel_err(got, want) <= 1e-4
    assert c.line() == "CUDA graphs: 1 captured, 3 replays, 2 steps launched eagerly"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_equal_eager_steps_on_the_gpu(tmp_path) -> None:
    model = Model.load(write_tiny_model(tmp_path / "g.gguf", TinySpec()), "cuda")
    params = ContextParams(n_ctx=256, n_ubatch=8)
    want_toks, want = greedy(Context(Model.load(model.path), params, backends.create("torch")), PROMPT, 6)
    ops = backends.create("cuda")
    toks, got = greedy(Context(model, params, ops), PROMPT, 6, want_toks)
    assert toks == want_toks and rel_err(got.cpu(), want) <= 1e-4
    assert ops.graph_runner.counters.replays >= 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_device_flag_without_a_gpu() -> None:
    """`--device cuda` without a GPU: one line, exit 1, before a model loads; auto is the CPU."""
    from cli_inproc import run_cli

    from ubatch.cli.device import DeviceError, resolve_device

    for cmd in (["bench", "-p", "8", "-n", "0"], ["batched-bench", "-npp", "8", "-ntg", "1", "-npl", "1"]):
        r = run_cli([*cmd, "--device", "cuda"])
        assert r.returncode == 1
        assert r.stderr.splitlines() == [
            "error: --device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False); use --device cpu"
        ]
    assert resolve_device("auto", "cpu") == (torch.device("cpu"), "cpu")
    assert resolve_device("none") == (torch.device("cpu"), "auto")  # llama.cpp's spelling
    with pytest.raises(DeviceError, match="--device tpu: unknown device; use cuda, cpu or auto"):
        resolve_device("tpu")
