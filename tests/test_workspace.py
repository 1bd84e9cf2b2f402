"""The workspace is real: a forward pass allocates no intermediate tensor outside it.

A TorchDispatchMode sees every aten op the graph executor runs; any op output whose storage is
not the workspace, the KV cache or a weight is an allocation the plan did not account for.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.graph import graph as graph_mod
from ubatch.engine.graph.workspace import Request, lay_out
from ubatch.engine.params import ContextParams


class AllocationWatch(TorchDispatchMode):
    def __init__(self, allowed: set[int]) -> None:
        super().__init__()
        self.allowed, self.foreign = allowed, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor) and o.numel() and o.untyped_storage().data_ptr() not in self.allowed:
                self.foreign.append((str(func), tuple(o.shape)))
        return out


def watch_forward_passes(ctx: Context, monkeypatch: pytest.MonkeyPatch) -> list:
    """Wrap run_graph so only the forward pass itself is watched (inputs are prepared outside)."""
    found: list = []
    real = graph_mod.run_graph

    def watched(g, ops, workspace, inputs):
        allowed = {workspace.untyped_storage().data_ptr()}
        # the output buffer: the last node writes the logits rows there itself
        allowed |= {t.untyped_storage().data_ptr() for t in (ctx._outputs, ctx._embd_out)}
        allowed |= {t.untyped_storage().data_ptr() for t in inputs.values()}
        for c in ctx.memory.caches:
            allowed |= {s.data.untyped_storage().data_ptr() for s in (*c.k.values(), *c.v.values())}
        for w in ctx.model.matrices():  # the stored blocks, and the reference's dense copies
            allowed.add(w.raw.untyped_storage().data_ptr())
        allowed |= {t.untyped_storage().data_ptr() for t in getattr(ops, "_dense", {}).values()}
        with AllocationWatch(allowed) as m:
            out = real(g, ops, workspace, inputs)
        found.extend(m.foreign)
        return out

    monkeypatch.setattr("ubatch.engine.graph.cuda_graphs.run_graph", watched)
    return found


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_forward_allocates_nothing_outside_the_workspace(tiny_gemma_model, monkeypatch, kv: str, backend: str) -> None:
    m = tiny_gemma_model
    ctx = Context(m, ContextParams(n_ctx=256, n_ubatch=32, n_seq_max=2, type_k=kv, type_v=kv, backend=backend))
    ctx.warmup()
    found = watch_forward_passes(ctx, monkeypatch)
    ctx.decode(Batch.from_tokens([2] + list(range(10, 70)), 0))  # two ubatches
    for i in range(3):
        ctx.decode(Batch.from_tokens([10 + i], 61 + i))
    b = Batch()
    for i in range(5):
        b.add(20 + i, i, 1, i == 4)
    ctx.decode(b)
    assert ctx.perf.n_ubatch == 6
    assert found == []


@pytest.mark.slow
def test_default_model_prompt_and_generation_stay_in_the_reservation(default_model, monkeypatch) -> None:
    ctx = Context(default_model, ContextParams(n_ctx=1024, n_outputs_max=1))
    ctx.warmup()
    found = watch_forward_passes(ctx, monkeypatch)
    ctx.decode(Batch.from_tokens([2] + [1000 + i for i in range(511)], 0))
    for i in range(16):  # past 512 cells: the decode graphs of the next 256-cell bucket
        ctx.decode(Batch.from_tokens([int(ctx.logits[-1].argmax())], 512 + i))
    assert found == []
    assert ctx.workspace_regrows == 0
    assert max(g.size for g in ctx._graphs.values()) <= ctx.reservation.bytes == ctx.workspace.numel()


def test_planner_shares_memory_between_tensors_whose_lives_do_not_overlap() -> None:
    p = lay_out([Request(0, 100, 0, 1), Request(1, 100, 1, 2), Request(2, 100, 2, 3)])
    assert p.offsets[0] == p.offsets[2] != p.offsets[1]  # 0 dies at step 1, 2 is born at 2
    assert p.size == 2 * 128


def test_planner_reuses_an_input_in_place() -> None:
    p = lay_out([Request(0, 256, 0, 1), Request(1, 256, 1, 2, inplace_of=0)])
    assert p.offsets[1] == p.offsets[0] and p.size == 256


def test_compute_buffer_shrinks_with_ubatch_not_with_batch(tiny_gemma_model) -> None:
    m = tiny_gemma_model

    def size(b: int, ub: int) -> int:
        return Context(m, ContextParams(n_ctx=1024, n_batch=b, n_ubatch=ub, n_outputs_max=1)).reservation.bytes

    assert size(2048, 512) > size(2048, 256) > size(2048, 128) > size(2048, 64)
    assert size(2048, 256) == size(1024, 256) == size(256, 256)
    assert size(64, 512) == size(2048, 64)  # -b below -ub: the ubatch is clamped to the batch


def test_an_allocation_failure_names_the_buffer_and_its_size(tiny_gemma_model, monkeypatch) -> None:
    from ubatch.engine.errors import ContextError

    m = tiny_gemma_model
    real_empty = torch.empty

    def failing_empty(*a, **kw):
        if kw.get("dtype") is torch.uint8 and a and isinstance(a[0], int) and a[0] > 100_000:
            raise RuntimeError("DefaultCPUAllocator: not enough memory")
        return real_empty(*a, **kw)

    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.raises(ContextError, match=r"compute buffer \([0-9.]+ MiB\).*not enough memory"):
        Context(m, ContextParams(n_ctx=1024, n_ubatch=256))


def test_decode_steps_inside_a_256_cell_bucket_reuse_the_graph(tiny_gemma_model) -> None:
    m = tiny_gemma_model
    ctx = Context(m, ContextParams(n_ctx=1024, n_ubatch=512))
    ctx.decode(Batch.from_tokens([2] + [9] * 249, 0))  # 250 cells used
    reused = []
    for i in range(10):  # positions 250..259: the base cache crosses 256 at the 7th step
        ctx.decode(Batch.from_tokens([9], 250 + i))
        reused.append(ctx.records[0].reused)
    assert reused == [False] + [True] * 5 + [False] + [True] * 3
    assert ctx.records[0].n_kv[0] == 512


@pytest.mark.parametrize("ub", [1, 3, 8, 16, 32])
def test_small_ubatches_fit_the_reservation(tiny_gemma_model, ub: int) -> None:
    """Smaller shapes than the worst case must run in the reserved buffer, however they fragment."""
    ctx = Context(tiny_gemma_model, ContextParams(n_ctx=1024, n_ubatch=ub, n_outputs_max=1))
    ctx.decode(Batch.from_tokens([2] + list(range(10, 109)), 0))
    for i in range(3):
        ctx.decode(Batch.from_tokens([9], 100 + i))
    assert ctx.workspace_regrows == 0
    assert max(g.size for g in ctx._graphs.values()) <= ctx.workspace.numel()
