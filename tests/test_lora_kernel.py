"""The segmented LoRA kernel (kernels/ops.py `LoraArgs`): each row gathers its own adapters' A and
Bᵀ from the stack, in one call for all adapters of a ubatch. The CPU C kernels (AVX-512, AVX2,
portable) and the Triton kernel (tests/test_triton_ops.py runs it interpreted) against a plain
per-row loop in float64, at several row counts, adapter counts, ranks and factor dtypes; mixed
adapters and slots in one call; a row's result the same whatever rows share its call.

Tolerance: max |error| / max |delta| <= 1e-5 (f32 products in another order).
"""

from __future__ import annotations

import pytest
import torch

from ubatch.kernels import backends
from ubatch.kernels.ops import LoraArgs, LoraStack, Ops
from ubatch.kernels.torch_ops import TorchOps

BACKENDS = ["torch", "cpu", "cpu-avx2", "cpu-portable"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_stack(ranks: list[int], n_in: int, n_out: int, dtype: torch.dtype, seed: int = 0) -> LoraStack:
    """Adapters of the given ranks (0: not targeting this matrix), zero-padded to the largest."""
    g = torch.Generator().manual_seed(seed)
    r = max(ranks)
    a = torch.zeros(len(ranks), r, n_in, dtype=dtype)
    bt = torch.zeros(len(ranks), r, n_out, dtype=dtype)
    for k, rk in enumerate(ranks):
        a[k, :rk] = (torch.randn(rk, n_in, generator=g) / n_in**0.5).to(dtype)
        bt[k, :rk] = torch.randn(rk, n_out, generator=g).to(dtype)
    c = torch.tensor([2.0 / rk if rk else 0.0 for rk in ranks])
    return LoraStack(a, bt, torch.tensor(ranks, dtype=torch.int32), c)


def per_row(y: torch.Tensor, x: torch.Tensor, w: LoraStack, idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The definition, row by row in float64."""
    out = y.double().clone()
    for r in range(x.shape[0]):
        d = torch.zeros(y.shape[1], dtype=torch.float64)
        for j in range(idx.shape[1]):
            k = int(idx[r, j])
            if k < 0 or not int(w.rank[k]):
                continue
            rk = int(w.rank[k])
            t = w.a[k, :rk].double() @ x[r].double() * float(scale[r, j]) * float(w.c[k])
            d += t @ w.bt[k, :rk].double()
        out[r] += d
    return out


def rows_of(n: int, m: int, n_adapters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's adapters (-1: none in that slot) and scales."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, n_adapters, (n, m), generator=g, dtype=torch.int32)
    return idx, torch.rand(n, m, generator=g) * 2 - 0.5


@pytest.fixture(scope="module", params=BACKENDS)
def ops(request: pytest.FixtureRequest) -> Ops:
    return backends.create(request.param, 2)


def run(ops: Ops, a: LoraArgs[torch.Tensor], inplace: bool) -> torch.Tensor:
    """The op as a graph runs it: bound once (a C call on the CPU backends), then called."""
    out = a.y if inplace else torch.empty_like(a.y)
    ops.bind(a, out, [])()
    return out


def check(got: torch.Tensor, y: torch.Tensor, want: torch.Tensor) -> None:
    delta = (want - y.double()).abs().max().item() or 1.0
    assert (got.double() - want).abs().max().item() / delta <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    ("n", "ranks", "m"), [(1, [16], 1), (3, [8, 16, 4, 0], 1), (16, [4, 64, 16], 2), (77, [32, 8], 1)]
)
def test_kernel_matches_the_per_row_definition(ops: Ops, dtype: torch.dtype, n: int, ranks: list[int], m: int) -> None:
    """Odd widths (n_in 100, n_out 83) reach every vector loop's tail."""
    w = make_stack(ranks, 100, 83, dtype, seed=n)
    x, y = torch.randn(n, 100), torch.randn(n, 83)
    idx, scale = rows_of(n, m, len(ranks), seed=n)
    want = per_row(y, x, w, idx, scale)
    check(run(ops, LoraArgs(y.clone(), x, w, idx, scale), inplace=False), y, want)
    check(run(ops, LoraArgs(y.clone(), x, w, idx, scale), inplace=True), y, want)


def test_rows_without_an_adapter_are_left_alone(ops: Ops) -> None:
    w = make_stack([8, 8], 64, 48, torch.float16)
    x, y = torch.randn(4, 64), torch.randn(4, 48)
    idx = torch.tensor([[-1], [1], [-1], [0]], dtype=torch.int32)
    scale = torch.tensor([[1.0], [0.5], [3.0], [0.0]])  # a zero scale applies nothing either
    got = run(ops, LoraArgs(y.clone(), x, w, idx, scale), inplace=False)
    assert torch.equal(got[[0, 2, 3]], y[[0, 2, 3]]) and not torch.equal(got[1], y[1])


def test_sel_reads_the_output_rows_adapters(ops: Ops) -> None:
    """Past the last layer's cut x holds the output rows only; `sel` says which rows' adapters."""
    w = make_stack([8, 16], 64, 40, torch.float32)
    idx, scale = rows_of(10, 1, 2, seed=3)
    sel = torch.tensor([9, 2, 4], dtype=torch.int64)
    x, y = torch.randn(3, 64), torch.randn(3, 40)
    want = per_row(y, x, w, idx[sel], scale[sel])
    check(run(ops, LoraArgs(y.clone(), x, w, idx, scale, sel), inplace=False), y, want)


@pytest.mark.parametrize("backend", ["cpu", "cpu-avx2", "cpu-portable"])
def test_a_rows_result_does_not_depend_on_its_neighbours(backend: str) -> None:
    """Row 0 (adapter 1 at 0.7) alone, among 7 rows of other adapters, and among 300 rows (the
    parallel path): bit-identical."""
    ops = backends.create(backend, 2)
    w = make_stack([16, 8, 32, 4], 256, 320, torch.float16)
    x0, y0 = torch.randn(1, 256), torch.randn(1, 320)
    outs = []
    for n in (1, 8, 300):
        x, y = torch.cat([x0, torch.randn(n - 1, 256)]), torch.cat([y0, torch.randn(n - 1, 320)])
        idx, scale = rows_of(n, 2, 4, seed=n)
        idx[0], scale[0] = torch.tensor([1, -1], dtype=torch.int32), torch.tensor([0.7, 0.0])
        outs.append(run(ops, LoraArgs(y, x, w, idx, scale), inplace=False)[0])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_the_cpu_backends_bind_the_c_kernel() -> None:
    """Not the reference's Python fallback: a C call the graph's program fuses."""
    from ubatch.kernels.cpu.program import CCall

    w = make_stack([8], 32, 16, torch.float16)
    a = LoraArgs(torch.zeros(2, 16), torch.randn(2, 32), w, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1))
    for name in ("cpu", "cpu-avx2", "cpu-portable"):
        assert isinstance(backends.create(name, 2).bind(a, a.y, []), CCall), name
    assert not isinstance(TorchOps().bind(a, a.y, []), CCall)
