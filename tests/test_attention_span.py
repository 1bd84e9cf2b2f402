"""Prefill attention narrows each score tile to the cells its queries can see.

A causal prefill hides the upper triangle: a block of early queries sees a prefix of a KV chunk
or none of it. The narrowed tiles must give what a dense softmax over every cell gives.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from ubatch.kernels import backends
from ubatch.kernels.ops import KV_CHUNK, AttentionArgs, KVTensor

BACKENDS = [b for b in backends.names() if b not in ("auto", "cuda")]


def causal_mask(g: int, t: int, n_kv: int, p0: int, window: int = 0) -> torch.Tensor:
    """Query i sits at cell p0 + i and sees cells <= its own (and > its own - window if set)."""
    qpos = torch.arange(p0, p0 + t)[:, None]
    cell = torch.arange(n_kv)[None, :]
    vis = cell <= qpos
    if window:
        vis &= cell > qpos - window
    return torch.where(vis, 0.0, float("-inf")).half().expand(g, t, n_kv).contiguous()


@pytest.mark.parametrize("backend", ["cpu", "cpu-avx2", "cpu-portable"])
def test_visible_span_of_a_causal_block(backend: str) -> None:
    span = backends.create(backend, n_threads=1).tiles.visible_span
    mask = causal_mask(2, 512, 512, 0)
    assert span(mask, 0, 128, 0, 256) == (0, 128)  # the block's own prefix
    assert span(mask, 0, 128, 256, 256) == (0, 0)  # a chunk in its future
    assert span(mask, 384, 128, 256, 256) == (0, 256)
    window = causal_mask(1, 512, 512, 0, window=64)
    assert span(window, 384, 128, 256, 256) == (384 - 63 - 256, 256)
    assert backends.create("torch").tiles.visible_span(mask, 0, 128, 256, 256) == (0, 256)  # the reference reads all


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "p0,window,d", [(0, 0, 64), (100, 0, 64), (0, 96, 64), (100, 0, 40)], ids=["causal", "offset", "swa", "d40"]
)
def test_narrowed_tiles_match_a_dense_softmax(backend: str, p0: int, window: int, d: int) -> None:
    """d = 40: the tile products' partial 32-wide panels (the CPU backend's C GEMM)."""
    ops = backends.create(backend, n_threads=2)
    g, t, h, hkv, n_kv = 1, 300, 4, 1, 512
    gen = torch.Generator().manual_seed(p0 + window)
    kf, vf = torch.randn(n_kv, hkv, d, generator=gen), torch.randn(n_kv, hkv, d, generator=gen)
    k, v = KVTensor(kf.half(), int(T.F16), hkv, d), KVTensor(vf.half(), int(T.F16), hkv, d)
    q = torch.randn(g, t, h, d, generator=gen)
    mask = causal_mask(g, t, n_kv, p0, window)
    visible = (mask != float("-inf")).view(g * t, n_kv // KV_CHUNK, KV_CHUNK).any(2).any(0)
    out = torch.empty(g * t, h * d)
    spec = ops.attention_scratch(q.shape, k, v, n_kv)  # what the graph builder would plan
    scratch = [torch.empty(s, dtype=dt) for s, dt in spec]
    got = ops.attention(AttentionArgs(q, k, v, torch.tensor([0]), n_kv, mask, 0.125, visible), out, scratch)

    kd, vd = k.data.double()[:, 0], v.data.double()[:, 0]
    scores = torch.einsum("thd,cd->thc", q[0].double(), kd) * 0.125 + mask[0].double()[:, None, :]
    want = torch.einsum("thc,cd->thd", scores.softmax(-1), vd).reshape(t, h * d)
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("backend", ["cpu", "cpu-avx2"])
def test_cpu_prefill_attention_is_one_fused_call_per_chunk(backend: str, monkeypatch) -> None:
    """The C backends take Q·Kᵀ, softmax and P·V of a chunk in one call (kernels/csrc/flash.c),
    never the reference's tile loop, when their planned scratch is given."""
    from ubatch.kernels.torch_ops import AttentionTiles

    def tile_loop(*args, **kwargs) -> None:
        raise AssertionError("the reference's tile loop ran")

    monkeypatch.setattr(AttentionTiles, "chunk_attention", tile_loop)
    for p0, window, d in [(0, 0, 64), (100, 0, 40), (0, 96, 64)]:
        test_narrowed_tiles_match_a_dense_softmax(backend, p0, window, d)
