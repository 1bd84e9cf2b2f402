"""Reporting on the cuda backend, with CPU stand-ins: the startup log names the device that holds
the KV cache and the compute buffer (llama.cpp's `CUDA0 compute buffer size = ...`), and the
CUDA-graph counters appear in the performance summary and per test in `ubatch bench`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import triton_interp  # noqa: F401  (interpreter mode before any kernel module is imported)
from cli_inproc import run_cli
from test_cuda_backend import PROMPT, ReferenceMatmul, _Recorded, cuda_ops, greedy, models  # noqa: F401  (fixture)

from ubatch.cli.memory_view import breakdown_table, llama_lines
from ubatch.cli.present import perf_lines
from ubatch.engine.completion.complete import CompletionStats
from ubatch.engine.context.context import Context
from ubatch.engine.context.report import memory_plan
from ubatch.engine.params import ContextParams
from ubatch.kernels import backends
from ubatch.kernels.cuda.graphs import CudaGraphRunner
from ubatch.kernels.cuda.ops import CudaOps


def test_the_startup_lines_name_the_device_of_the_buffers(models) -> None:  # noqa: F811
    plan = memory_plan(Context(models["llama"], ContextParams(n_ctx=256), backends.create("torch")))
    assert plan.device == "cpu"
    cpu = llama_lines(plan)
    assert any(line.startswith("sched_reserve:        CPU compute buffer size = ") for line in cpu)
    gpu = llama_lines(replace(plan, device="cuda:0"))  # what a context on the GPU reports
    assert [x for x in gpu if "compute buffer size" in x] == [
        f"sched_reserve:      CUDA0 compute buffer size = {plan.compute_bytes / 2**20:8.2f} MiB"
    ]
    assert [x for x in gpu if "KV buffer size" in x][0].startswith("llama_kv_cache:      CUDA0 KV buffer size = ")
    assert [x for x in gpu if "output buffer" in x][0].startswith("llama_context:        CPU  output")  # host rows
    assert breakdown_table(replace(plan, device="cuda:1")).columns[0]._cells == ["CUDA1"]


def test_the_performance_summary_shows_the_cuda_graph_counters(models, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(CudaGraphRunner, "capture", staticmethod(_Recorded))
    ops = cuda_ops()
    ctx = Context(models["llama"], ContextParams(n_ctx=256, n_ubatch=8), ops)
    assert perf_lines(ctx, CompletionStats(), 0.0, 0.0)[-1] == (
        "common_perf_print: CUDA graphs: off (the kernels run in Triton's interpreter)"
    )
    ops.cuda_graphs = True
    greedy(ctx, PROMPT[:4], 3)
    assert perf_lines(ctx, CompletionStats(), 0.0, 0.0)[-1] == (
        "common_perf_print: CUDA graphs: 1 captured, 2 replays, 2 steps launched eagerly"
    )
    torch_ctx = Context(models["llama"], ContextParams(n_ctx=256), backends.create("torch"))
    assert "CUDA graphs" not in perf_lines(torch_ctx, CompletionStats(), 0.0, 0.0)[-1]


def test_bench_prints_the_cuda_graph_counters_per_test(models, monkeypatch) -> None:  # noqa: F811
    """A stand-in capture on the CPU: the tg test's decodes go through the graph runner."""
    monkeypatch.setattr(CudaGraphRunner, "capture", staticmethod(_Recorded))
    init = CudaOps.__init__

    def with_graphs(self, n_threads: int = 1) -> None:  # type: ignore[no-untyped-def]
        init(self, n_threads)
        self.cuda_graphs, self._mm = True, ReferenceMatmul  # the interpreter's matmul is slow

    monkeypatch.setattr(CudaOps, "__init__", with_graphs)
    path = Path(models["llama"].path)
    r = run_cli(["bench", "-m", str(path), "--backend", "cuda", "-p", "4", "-n", "3", "-r", "1", "-t", "1"])
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "CUDA graphs" in x]
    assert len(lines) == 2, r.stderr
    # pp4: the warm-up eager, the repetition captured and replayed; tg3: per repetition, the
    # warm-up's shape is captured, then replayed (the first token of a decode opens the shape)
    assert lines[0] == "pp4, b 2048, ub 512, t 1: CUDA graphs: 1 captured, 1 replays, 1 steps launched eagerly"
    assert lines[1].startswith("tg3, b 2048, ub 512, t 1: CUDA graphs: ")
    r = run_cli(["bench", "-m", str(path), "--backend", "torch", "-p", "4", "-n", "0", "-r", "1", "-t", "1"])
    assert r.returncode == 0 and "CUDA graphs" not in r.stderr
