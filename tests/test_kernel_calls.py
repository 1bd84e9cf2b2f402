"""The CPU backend's call structure: fused programs and row-count independence.

A graph's C calls run as fused `ub_run` programs (kernels/cpu/program.py), and a row of a
product must not depend on how many rows share the call (speculative verification compares a
drafted batch against one-row decodes token for token).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_kernels import FLOATS, QUANT, reads_x16, run_linear, weight

from ubatch.kernels import backends
from ubatch.kernels.cpu.ops import IQ_TYPES, CpuOps


def test_a_fused_program_computes_what_its_calls_compute_one_by_one() -> None:
    """Bound C calls fused into one ub_run call (program.fuse) give bit-identical outputs,
    and a step that is not a C call splits the program."""
    from ubatch.kernels.cpu.program import CCall, Program
    from ubatch.kernels.ops import AddArgs, GluArgs, LinearArgs, RmsNormArgs, ScaleArgs

    ops = CpuOps(2)
    w = weight(T.Q5_0, 48, 64)
    x, g = torch.randn(3, 64), torch.randn(64)
    bufs = [torch.empty(3, 48), torch.empty(3, 64), torch.empty(3, 64), torch.empty(3, 48)]

    def steps(out: list[torch.Tensor], marker: list[int]) -> list:
        y, n, s, a = out
        calls = [
            ops.bind(LinearArgs(x, w), y, []),
            ops.bind(RmsNormArgs(x, g, 1e-6), n, []),
            ops.bind(ScaleArgs(n, 0.5), s, []),
            lambda: marker.append(1),  # a Python step between C calls
            ops.bind(AddArgs(y, y), a, []),
            ops.bind(GluArgs(y, a, "gelu_tanh"), a, []),
        ]
        assert all(isinstance(c, CCall) for i, c in enumerate(calls) if i != 3)
        return calls

    one = [torch.zeros_like(b) for b in bufs]
    seen: list[int] = []
    for f in steps(one, seen):
        f()
    fused_bufs = [torch.zeros_like(b) for b in bufs]
    fused = ops.fuse(steps(fused_bufs, seen))
    assert [type(f).__name__ for f in fused] == ["Program", "function", "Program"]
    assert isinstance(fused[0], Program) and len(fused[0].calls) == 3
    for f in fused:
        f()
    assert seen == [1, 1]
    for a, b in zip(one, fused_bufs):
        assert torch.equal(a, b)


BUILDS = ["cpu", "cpu-avx2", "cpu-portable"]  # the native (AVX-512 here if the CPU has it), AVX2 and portable kernels


@pytest.mark.parametrize("backend", BUILDS)
@pytest.mark.parametrize("t", QUANT + FLOATS, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(t: T, backend: str) -> None:
    """Speculative verification relies on it: a drafted batch of 1 + k rows must give each row
    exactly what a one-row decode gives (else a greedy tie can flip between the two); on AVX2 each
    row's x is rounded to 16-bit integers on its own, so the same holds. On AVX2, 7 (K-quants:
    10) to 16 rows of a chunk count divisible by 4 take the rows-in-lanes kernel (the 256 wide
    rows here), the others tiles of 8 rows: each must give a row the bits of the one-row call."""
    ops = backends.create(backend, 2)
    kq = GGML_QUANT_SIZES[t][0] == 256  # the K-quants, IQ4_XS and the grid types
    for k in (256, 512) if kq else (96, 256):
        w = weight(t, 40, k, seed=k)
        x = torch.randn(16, k, generator=torch.Generator().manual_seed(7))
        x[3, 17] = 50.0  # an outlier, as hidden states have
        whole = run_linear(ops, w, x)
        for rows in (
            [0],
            [3],
            [5, 6],
            [1, 2, 3, 4, 5],
            list(range(7)),
            list(range(9)),
            list(range(2, 12)),
            list(range(13)),
        ):
            part = run_linear(ops, w, x[rows].contiguous())
            assert torch.equal(part, whole[rows]), (k, rows)


def test_a_k_quant_row_longer_than_the_rows_in_lanes_buffer_takes_the_tiles() -> None:
    """The rows-in-lanes GEMV keeps a K-quant row's scales in a fixed buffer of 1024 chunks: a
    row of 1024 chunks takes it (its scratch holds the panel), a row of 1032 the tiles of 8 (no
    panel), and each row still gets the one-row call's bits."""
    ops = backends.create("cpu-avx2", 2)
    assert isinstance(ops, CpuOps)

    def base(m: int, k: int) -> int:  # x as 16-bit integers, its scales and sums
        return (m * k // 2 + 15) // 16 * 16 + 2 * m * (k // 32)

    for nc, panel in ((1024, True), (1032, False)):
        k = nc * 32
        w = weight(T.Q4_K, 8, k, seed=nc)
        x = torch.randn(12, k, generator=torch.Generator().manual_seed(nc))
        if ops.kernels.x16:
            assert ops.kernels.gemv_scratch(12, w) == base(12, k) + (8 + 3 * nc * 80 if panel else 0)
        whole = run_linear(ops, w, x)
        assert torch.equal(run_linear(ops, w, x[5:6].contiguous()), whole[5:6])


@pytest.mark.parametrize("backend", BUILDS)
@pytest.mark.parametrize("t", QUANT + FLOATS, ids=lambda t: t.name)
def test_the_gemv_scratch_is_planned_and_its_contents_do_not_matter(t: T, backend: str) -> None:
    """The GEMV's scratch (AVX2: x as 16-bit integers with its scales and sums for block types,
    x in the decoders' lane order for none now; AVX-512: for the K-quants x as two planes of
    16-bit integers, its scales and sums (csrc/gemv_vnni.c), else nothing) comes from the plan:
    linear_scratch asks for exactly what the kernel uses, a planned buffer full of NaN, the
    kernel's own allocation (a direct call) and a strided x all give the same bits."""
    ops = backends.create(backend, 2)
    assert isinstance(ops, CpuOps)
    kq = GGML_QUANT_SIZES[t][0] == 256
    for k, m in itertools.product((512,) if kq else (160, 256), (1, 5, 8, 12, 16)):
        w = weight(t, 40, k)
        need = ops.kernels.gemv_scratch(m, w)
        spec = ops.linear_scratch(m, w)
        assert spec == ([((need,), torch.float32)] if need else [])
        x16 = reads_x16(ops, t)  # int16 x (half a float a value), scales, sums
        # from 7 rows (K-quants: 10), where the chunks go in fours (not Q5_0/Q5_1 unless repacked
        # to Q8_0): the rows-in-lanes panel, per group of four rows and chunk 64 floats of x
        # pairs, 8 of scales, 8 of sums (+ 8 to align)
        fours = ops.kernels.repacks.kernel_type(w) not in (T.Q5_0, T.Q5_1)
        rows = (
            x16
            and int(t) not in IQ_TYPES
            and m >= (10 if t in (T.Q4_K, T.Q5_K, T.Q6_K) else 7)
            and k % 128 == 0
            and fours
        )
        panel = 8 + (m + 3) // 4 * (k // 32) * 80 if rows else 0
        # AVX-512 with AVX512-BW, K-quants: x as two int16 planes, one scale per 256 values, eight sums
        vnni = ops.kernels.vnni and t in (T.Q4_K, T.Q5_K, T.Q6_K)
        x16_need = (m * k // 2 + 15) // 16 * 16 + 2 * m * (k // 32) + panel
        assert need == (x16_need if x16 else m * k + 9 * m * (k // 256) if vnni else 0)
        wide = torch.randn(m, k + 24, generator=torch.Generator().manual_seed(m))
        x = wide[:, :k]  # rows k + 24 floats apart
        planned = ops.linear(x, w, torch.empty(m, 40), [torch.full((max(need, 1),), float("nan"))])
        own = ops.linear(x.contiguous(), w, torch.empty(m, 40))
        assert torch.equal(planned, own), m


@pytest.mark.parametrize("n_seq", [8, 16])
def test_a_batch_of_the_default_model_gives_each_sequence_its_one_sequence_logits(default_model, n_seq: int) -> None:
    """The real model on the AVX2 build: 8 and 16 sequences decoded together take the
    rows-in-lanes GEMV (8: the head and the Q8_0 layers; 16: the K-quants too) and each must get,
    bit for bit, the logits of its own one-sequence decode, which takes the one-row path."""
    from ubatch.engine.batch import Batch
    from ubatch.engine.context.context import Context
    from ubatch.engine.params import ContextParams

    ctx = Context(
        default_model, ContextParams(n_ctx=64 * n_seq, n_seq_max=n_seq, n_outputs_max=n_seq, backend="cpu-avx2")
    )
    tokens = [int(t) for t in torch.randint(0, 262144, (n_seq,), generator=torch.Generator().manual_seed(n_seq))]
    prompt = default_model.vocab.tokenize("The history of the printing press", add_special=True)

    def prefill(s: int) -> None:
        ctx.decode(Batch([*prompt], list(range(len(prompt))), [[s]] * len(prompt), [False] * len(prompt)))

    for s in range(n_seq):
        prefill(s)
    ctx.decode(Batch(tokens, [len(prompt)] * n_seq, [[s] for s in range(n_seq)], [True] * n_seq))
    together = ctx.logits.clone()
    for s in range(n_seq):
        ctx.memory.clear()
        prefill(s)
        ctx.decode(Batch([tokens[s]], [len(prompt)], [[s]], [True]))
        assert torch.equal(ctx.logits[0], together[s]), s
