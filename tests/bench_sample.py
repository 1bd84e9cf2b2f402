"""A llama-bench result with plausible values, for the tests of bench's formats: each test
replaces only the fields it is about (`dataclasses.replace(SAMPLE, ...)`)."""

from __future__ import annotations

from ubatch.cli.bench.result import BenchResult

SAMPLE = BenchResult(
    build_commit="0.1.0",
    build_number=0,
    cpu_info="cpu",
    gpu_info="",
    backends="CPU",
    model_filename="m.gguf",
    model_type="gemma3 270M Q4_K - Medium",
    model_size=253_000_000,
    model_n_params=268_098_176,
    n_batch=2048,
    n_ubatch=512,
    n_threads=2,
    type_k="f16",
    type_v="f16",
    n_gpu_layers=0,
    flash_attn=1,
    n_prompt=512,
    n_gen=0,
    n_depth=0,
    test_time="2026-01-01T00:00:00Z",
    avg_ns=0,
    stddev_ns=0,
    avg_ts=0.0,
    stddev_ts=0.0,
    samples_ns=[],
    samples_ts=[],
    test="pp512",
    n_ctx=512,
    n_batch_eff=512,
    n_ubatch_eff=512,
    n_outputs_max=512,
    compute_buffer_mib=513.0,
    used_buffer_mib=500.0,
    kv_mib=6.0,
    n_ubatches=1,
)
