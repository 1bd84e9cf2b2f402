"""The default CPU backend's kernel builds, chosen by measured speed (kernels/cpu/dispatch.py):
the rule, its cache, and a backend whose decode and prefill run on different builds."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.context.report import memory_plan
from ubatch.engine.params import ContextParams
from ubatch.kernels import backends
from ubatch.kernels.cpu import dispatch
from ubatch.kernels.cpu.build import cpu_flags
from ubatch.kernels.cpu.dispatch import BuildChoice, decide
from ubatch.kernels.cpu.ops import CpuOps
from ubatch.kernels.cpu.program import CCall, Program

AVX512 = "avx512f" in cpu_flags()
OPS = ("gemv1", "gemv4", "gemv16", "gemm128", "attention")


def _times(**ratio: float) -> tuple[dict[str, float], dict[str, float]]:
    """Native and AVX2 times whose ratios (native / AVX2) are as given, 1 elsewhere."""
    return {op: ratio.get(op, 1.0) for op in OPS}, dict.fromkeys(OPS, 1.0)


def test_the_avx2_build_takes_a_phase_only_where_it_wins_every_op() -> None:
    c = decide(*_times(gemv1=1.4, gemv4=1.3, gemv16=1.2, attention=1.1, gemm128=1.2))  # Zen 4
    assert (c.decode, c.prefill) == ("avx2", "avx2")
    assert c.ratios["gemv1"] == pytest.approx(1.4) and "faster at each of its ops" in c.reason
    # decode would take AVX2 and prefill AVX-512 (this Intel Xeon, prefill on AMX tiles): the
    # phases never split, since the builds round x differently
    c = decide(*_times(gemv1=1.16, gemv4=1.09, gemv16=1.21, attention=1.07, gemm128=0.55))
    assert (c.decode, c.prefill) == ("avx512", "avx512") and "prefill and decode read x alike" in c.reason
    assert "decode on the AVX2 build (faster at each of its ops" in c.reason
    # the builds split a phase's shapes (this Zen 5: the 1-row GEMV on AVX-512, 16 rows on AVX2)
    c = decide(*_times(gemv1=0.88, gemv4=1.05, gemv16=1.43, attention=1.37, gemm128=1.3))
    assert (c.decode, c.prefill) == ("avx512", "avx512")
    assert "faster at gemv4, gemv16, attention but not at gemv1" in c.reason
    # within the margin, noise: the native build stays
    c = decide(*_times(gemv1=1.02, gemv4=1.03, gemv16=1.01, attention=1.04, gemm128=1.04))
    assert (c.decode, c.prefill) == ("avx512", "avx512") and "less than 5%" in c.reason


@pytest.mark.skipif(not AVX512, reason="one build on a CPU without AVX-512: nothing to choose")
def test_the_choice_is_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[int] = []

    def fake(native: object, avx2: object) -> tuple[dict[str, float], dict[str, float]]:
        calls.append(1)
        return _times(gemv1=1.5, gemv4=1.5, gemv16=1.5, attention=1.5, gemm128=1.5)

    monkeypatch.setattr(dispatch, "time_ops", fake)
    first = dispatch.choose_build()
    assert (first.decode, first.prefill, first.cached) == ("avx2", "avx2", False)
    again = dispatch.choose_build()
    assert again.cached and (again.decode, again.reason, again.ratios) == (first.decode, first.reason, first.ratios)
    assert len(calls) == 1
    (cached,) = (tmp_path / "ubatch" / "kernels").glob("dispatch-*.json")
    cached.write_text("{not json")  # a damaged cache is measured again, not trusted
    assert not dispatch.choose_build().cached and len(calls) == 2
    assert json.loads(cached.read_text())["decode"] == "avx2"


@pytest.mark.skipif(not AVX512, reason="one build on a CPU without AVX-512: nothing to choose")
def test_the_real_probe_names_every_op() -> None:
    native, avx2 = dispatch.load(), dispatch.load(no_avx512=True)
    t_native, t_avx2 = dispatch.time_ops(dispatch.CpuKernels(native, 1), dispatch.CpuKernels(avx2, 1))
    assert set(t_native) == set(t_avx2) == set(OPS) and min(t_native.values()) > 0 and min(t_avx2.values()) > 0


def _mixed(monkeypatch: pytest.MonkeyPatch) -> CpuOps:
    """The default backend as it is on a CPU where decode measured faster on the AVX2 build."""
    monkeypatch.setattr(
        "ubatch.kernels.cpu.ops.choose_build",
        lambda: BuildChoice("avx2", "avx512", "decode on AVX2 (test)", {"gemv1": 1.5}),
    )
    ops = backends.create("auto", 1)
    assert isinstance(ops, CpuOps)
    return ops


@pytest.mark.skipif(not AVX512, reason="one build on a CPU without AVX-512: nothing to choose")
def test_decode_and_prefill_on_two_builds(tiny_gemma_model, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Decode graphs run (and fuse) in the AVX2 library, prefill's GEMMs in the native one; a
    decode-only run is then bit-equal to the cpu-avx2 backend's, and info says why."""
    ops = _mixed(monkeypatch)
    assert ops.kernels.library.simd == "avx2" and ops.prefill_kernels.library.simd == "avx512"
    assert ops.prefill_kernels.repacks is ops.kernels.repacks  # one layout of each weight
    assert ops.dispatch == ("decode on AVX2 (test)", "measured on this CPU, AVX-512 time / AVX2 time: gemv1 1.50x")
    m = tiny_gemma_model
    params = ContextParams(n_ctx=256, n_ubatch=64, n_batch=64, n_threads=1, backend="auto")
    ids = [2, 17, 33, 5, 9, 101, 42, 7]

    def one_by_one(o: CpuOps | None, backend: str) -> list[torch.Tensor]:
        ctx = Context(m, replace(params, backend=backend), ops=o)
        out = []
        for i, t in enumerate(ids):
            ctx.decode(Batch.from_tokens([t], i))
            out.append(ctx.logits[0].clone())
        return out

    for got, want in zip(one_by_one(ops, "auto"), one_by_one(None, "cpu-avx2"), strict=True):
        assert torch.equal(got, want)
    # a prefill graph: its GEMMs come from the native library, each fused program runs in the
    # library of its calls
    ctx = Context(m, params, ops=_mixed(monkeypatch))
    ctx.decode(Batch.from_tokens(ids * 4, 0))
    (g,) = [g for g in ctx._graphs.values() if g._bound is not None]
    native, avx2 = ctx.ops.prefill_kernels.lib, ctx.ops.kernels.lib  # type: ignore[attr-defined]
    gemms = [c for c in g._raw if isinstance(c, CCall) and c.op == "gemm"]
    assert gemms and all(c.fn is native.ub_gemm for c in gemms)
    assert any(isinstance(c, CCall) and c.fn is avx2.ub_gemv for c in g._raw)  # the output row's GEMV
    progs = [s for s in g._bound[1].steps if isinstance(s, Program)]
    for p in progs:
        (lib,) = {native if c.fn is getattr(native, c.fn.__name__) else avx2 for c in p.calls}
        assert p._run is lib.ub_run
    assert memory_plan(ctx).dispatch == ops.dispatch
