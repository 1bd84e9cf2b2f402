"""The records a bench run hands back: results in llama-bench's fields, and progress events.

They are plain data so that the CLI's printers (md/csv/json, the plot) and any script can read
them without running anything; a result also carries what llama-bench cannot tell (the compute
buffer reserved vs used, the tensors at its peak, the op profile). They belong to `ubatch bench`, so they sit in cli/bench/.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ubatch.cli.bench.params import BenchTest
from ubatch.kernels.cpu.peaks import MachinePeaks


@dataclass(slots=True)
class TensorShare:
    """One tensor alive at a compute-buffer peak: its name, shape and size in MiB."""

    name: str
    shape: tuple[int, ...]
    mib: float


@dataclass(slots=True)
class BenchResult:
    """llama-bench's record (the fields its csv/json printers write) plus ubatch's columns."""

    build_commit: str
    build_number: int
    cpu_info: str
    gpu_info: str
    backends: str
    model_filename: str
    model_type: str
    model_size: int
    model_n_params: int
    n_batch: int  # as requested (llama-bench reports the request)
    n_ubatch: int
    n_threads: int
    type_k: str
    type_v: str
    n_gpu_layers: int
    flash_attn: int
    n_prompt: int
    n_gen: int
    n_depth: int
    test_time: str
    avg_ns: int
    stddev_ns: int
    avg_ts: float
    stddev_ts: float
    samples_ns: list[int]
    samples_ts: list[float]
    # ubatch's columns
    test: str
    n_ctx: int  # effective (padded to 256)
    n_batch_eff: int  # after llama.cpp's clamps: min(n_ctx_requested, b)
    n_ubatch_eff: int  # min(n_batch_eff, ub)
    n_outputs_max: int  # effective
    compute_buffer_mib: float  # the reserved workspace (llama.cpp's "compute buffer size")
    used_buffer_mib: float  # the largest graph that actually ran in this test
    kv_mib: float
    n_ubatches: int  # forward passes per repetition
    stream_bytes: int = 0  # weight bytes a decode step reads: as stored plus the backend's repacks
    buffer_top: list[TensorShare] = field(default_factory=list)  # tensors alive at the reserved peak
    used_top: list[TensorShare] = field(default_factory=list)  # ... at the peak of the largest graph run
    profile_ms: dict[str, float] = field(default_factory=dict)  # per repetition, by op category
    # per repetition, by op category: (flops, bytes of weights or KV read); and the CPU's peaks
    profile_work: dict[str, tuple[float, float]] = field(default_factory=dict)
    peaks: MachinePeaks | None = None

    def to_dict(self, samples: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not samples:
            for k in ("samples_ns", "samples_ts", "buffer_top", "used_top", "profile_ms", "profile_work", "peaks"):
                d.pop(k)
        return d


@dataclass(slots=True)
class BenchEvent:
    """Progress: kind is 'load' (a model), 'context' (a new context), 'warmup', 'rep', 'done'
    (a test finished, `result` set) or 'note' (something the user should know, `text`)."""

    kind: str
    test_index: int = 0  # 1-based
    n_tests: int = 0
    rep: int = 0  # 1-based
    n_reps: int = 0
    test: BenchTest | None = None
    result: BenchResult | None = None
    text: str = ""


__all__ = ["TensorShare", "BenchResult", "BenchEvent"]
