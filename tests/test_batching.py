"""Batches, ubatches and splits behave as the essay and llama.cpp describe them."""

from __future__ import annotations

import pytest
import torch

from ubatch.engine.batch import Batch, split_equal, split_simple
from ubatch.engine.context.context import Context
from ubatch.engine.kv.memory import DecodeError
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams


@pytest.fixture
def gemma(tiny_gemma_model) -> Model:
    return tiny_gemma_model


def test_a_5000_token_prompt_is_three_decodes_and_ten_ubatches(gemma: Model) -> None:
    ctx = Context(gemma, ContextParams(n_ctx=5120, n_batch=2048, n_ubatch=512, type_k="f32", type_v="f32"))
    decodes: list[list[int]] = []
    orig = ctx.decode

    def spy(batch: Batch) -> None:
        orig(batch)
        decodes.append([r.n_tokens for r in ctx.records])

    ctx.decode = spy  # type: ignore[method-assign]
    ctx.prefill([2] + [7 + i % 300 for i in range(4999)])
    assert [sum(d) for d in decodes] == [2048, 2048, 904]
    assert [len(d) for d in decodes] == [4, 4, 2]
    assert decodes[2] == [512, 392]
    assert ctx.perf.n_ubatch == 10


def test_batch_smaller_than_ubatch_makes_batch_sized_ubatches(gemma: Model) -> None:
    ctx = Context(gemma, ContextParams(n_ctx=512, n_batch=64, n_ubatch=512))
    assert ctx.cparams.n_ubatch == 64  # clamped: a ubatch never exceeds the batch
    ctx.prefill([2] + list(range(7, 206)))
    assert ctx.perf.n_ubatch == 4 and ctx.perf.n_decode == 4  # 200 tokens = 64 + 64 + 64 + 8


def test_split_simple_ignores_sequences() -> None:
    b = Batch()
    for i in range(10):
        b.add(7, i // 2, i % 2)
    assert [u.n_tokens for u in split_simple(b, 4)] == [4, 4, 2]


def test_split_equal_takes_equal_shares_per_sequence() -> None:
    """Non-unified KV: [seq0 x 100, seq1 x 1] becomes ubatches of 2 and 99 slots."""
    b = Batch()
    for i in range(100):
        b.add(7, i, 0)
    b.add(8, 0, 1)
    ubs = split_equal(b, 512, sequential=True)
    assert [u.n_tokens for u in ubs] == [2, 99]
    assert ubs[0].n_seqs == 2 and ubs[0].seq_id0.tolist() == [0, 1]


def test_unified_and_split_caches_split_as_llama_cpp(gemma: Model) -> None:
    def ubatch_sizes(kvu: bool) -> list[int]:
        ctx = Context(gemma, ContextParams(n_ctx=1024, n_seq_max=2, kv_unified=kvu))
        b = Batch()
        for i in range(100):
            b.add(7 + i, i, 0)
        b.add(8, 0, 1, True)
        ctx.decode(b)
        return [r.n_tokens for r in ctx.records]

    assert ubatch_sizes(kvu=True) == [101]
    assert ubatch_sizes(kvu=False) == [2, 99]


def test_coupled_sequences_need_a_unified_cache(gemma: Model) -> None:
    ctx = Context(gemma, ContextParams(n_ctx=512, n_seq_max=2))
    b = Batch()
    b.add(7, 0, [0, 1], True)
    with pytest.raises(DecodeError, match="-kvu") as e:
        ctx.decode(b)
    assert e.value.code == 1
    ctx = Context(gemma, ContextParams(n_ctx=512, n_seq_max=2, kv_unified=True))
    ctx.decode(b)  # fine with one stream


@pytest.mark.parametrize(
    "build, msg",
    [
        (lambda b: b.add(7, 0, 5), r"invalid seq_id\[0\]\[0\] = 5 >= 2"),
        (lambda b: b.add(99999, 0, 0), r"invalid token\[0\] = 99999"),
        (lambda b: (b.add(7, 0, 0), b.add(7, 2, 0)), "positions are not continuous"),
        (lambda b: (b.add(7, 1, 0), b.add(7, 0, 0)), "positions are decreasing"),
        (lambda b: None, "n_tokens == 0"),
    ],
)
def test_invalid_batches_are_refused_with_llama_cpp_messages(gemma: Model, build, msg: str) -> None:
    ctx = Context(gemma, ContextParams(n_ctx=256, n_seq_max=2, kv_unified=True))
    b = Batch()
    build(b)
    with pytest.raises(DecodeError, match=msg) as e:
        ctx.decode(b)
    assert e.value.code == -1 and ctx.memory.used == 0


def test_positions_must_continue_the_cache(gemma: Model) -> None:
    ctx = Context(gemma, ContextParams(n_ctx=256))
    ctx.decode(Batch.from_tokens(list(range(7, 17)), 0))
    with pytest.raises(DecodeError, match="Y = X \\+ 1"):
        ctx.decode(Batch.from_tokens([7], 12))
    assert ctx.memory.used == 10


def test_more_tokens_than_n_batch_is_an_error(gemma: Model) -> None:
    ctx = Context(gemma, ContextParams(n_ctx=256, n_batch=32))
    with pytest.raises(DecodeError, match="n_batch = 32"):
        ctx.decode(Batch.from_tokens(list(range(7, 47)), 0))


def test_a_full_cache_fails_without_changing_it(gemma: Model) -> None:
    ctx = Context(gemma, ContextParams(n_ctx=256, n_ubatch=100, type_k="f32", type_v="f32"))
    ctx.decode(Batch.from_tokens([7] * 200, 0))
    base = [c.streams[0].pos.copy() for c in ctx.memory.caches]
    with pytest.raises(DecodeError, match="failed to find a memory slot") as e:
        ctx.decode(Batch.from_tokens([7] * 100, 200))  # the second ubatch cannot fit
    assert e.value.code == 1
    for c, p in zip(ctx.memory.caches, base):
        assert (c.streams[0].pos == p).all()


def test_outputs_come_back_in_batch_order(gemma: Model) -> None:
    """split_equal regroups slots by sequence; logits rows still follow the batch."""

    def run(kvu: bool) -> torch.Tensor:
        ctx = Context(gemma, ContextParams(n_ctx=512, n_seq_max=2, kv_unified=kvu, type_k="f32", type_v="f32"))
        b = Batch()
        for i in range(5):
            b.add(7 + i, i, 0, True)
            b.add(20 + i, i, 1, True)
        ctx.decode(b)
        assert ctx.output_ids == list(range(10))
        return ctx.logits

    torch.testing.assert_close(run(False), run(True), atol=1e-4, rtol=1e-4)
