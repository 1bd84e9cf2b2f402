"""Generation loop: context full -> stop, or context shift as llama-completion does it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ubatch.engine.batch import Batch
from ubatch.engine.completion.complete import CompletionStats, complete
from ubatch.engine.context.context import Context
from ubatch.engine.errors import ContextError
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams

PROMPT = [2] + list(range(30, 60))
# a prompt that nearly fills a 256-token context: generation reaches the end within a few tokens
LONG = [2] + [7 + (i * 37) % 300 for i in range(239)]


@pytest.fixture
def llama(tiny_llama_model) -> Model:
    return tiny_llama_model


@pytest.fixture
def gemma(tiny_gemma_model) -> Model:
    return tiny_gemma_model


def test_a_full_context_stops_generation(llama: Model) -> None:
    ctx = Context(llama, ContextParams(n_ctx=256))
    st = CompletionStats()
    out = list(
        complete(ctx, LONG, Sampler(SamplerParams(temp=0)), GenerationParams(n_predict=1000, ignore_eos=True), st)
    )
    assert st.stop_reason == "context"
    assert st.n_past == 255 and st.n_gen == 256 - len(LONG) and out  # stops when n_past + 1 >= n_ctx


def test_context_shift_keeps_the_prefix_and_drops_half(llama: Model) -> None:
    ctx = Context(llama, ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    st = CompletionStats()
    n_predict = 256 - len(LONG) + 30  # the context fills after 16 tokens: shift, then 30 more
    params = GenerationParams(n_predict=n_predict, ignore_eos=True, ctx_shift=True, n_keep=4)
    list(complete(ctx, LONG, Sampler(SamplerParams(temp=0)), params, st))
    assert st.stop_reason == "length" and st.n_gen == n_predict and st.n_shifts >= 1
    # the cache now holds: 4 kept tokens, then the tail that survived, at consecutive positions
    cells = ctx.memory.caches[0].streams[0]
    pos = sorted(cells.pos[cells.pos >= 0].tolist())
    assert pos == list(range(st.n_past)) and st.n_past < 256


def test_shift_re_rotates_the_kept_keys_to_their_new_positions(llama: Model) -> None:
    """After discarding, layer 0's cached K of the surviving tokens equals a fresh run's K at the
    new positions (deeper layers legitimately differ: they once saw the dropped tokens)."""
    from ubatch.engine.generation.generation import shift_sequence

    m = llama
    ctx = Context(m, ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    ids = [2] + [7 + (i * 37) % 300 for i in range(254)]
    ctx.decode(Batch.from_tokens(ids, 0))
    assert 255 - shift_sequence(ctx.memory, 0, 255, 4) == 130
    ctx.memory.update(m.hparams, ctx.ops, ctx.rope_freqs)
    fresh = Context(m, ContextParams(n_ctx=256, type_k="f32", type_v="f32"))
    fresh.decode(Batch.from_tokens(ids[:4] + ids[129:], 0))
    got, ref = ctx.memory.caches[0], fresh.memory.caches[0]
    cells = np.flatnonzero(got.streams[0].pos >= 0)
    order = cells[np.argsort(got.streams[0].pos[cells])]
    torch.testing.assert_close(got.k[0].data[order], ref.k[0].data[:130], atol=1e-5, rtol=1e-5)


def test_context_shift_needs_a_full_swa_cache(gemma: Model) -> None:
    ctx = Context(gemma, ContextParams(n_ctx=512, n_ubatch=64))
    assert ctx.memory.caches[1].size == 256  # the SWA cache holds only window + ubatch
    with pytest.raises(ContextError, match="--swa-full"):
        list(complete(ctx, PROMPT, Sampler(SamplerParams(temp=0)), GenerationParams(n_predict=10, ctx_shift=True)))
    full = Context(gemma, ContextParams(n_ctx=256, swa_full=True))
    st = CompletionStats()
    n_predict = 256 - len(LONG) + 30  # past the end of the context: one shift on the way
    params = GenerationParams(n_predict=n_predict, ignore_eos=True, ctx_shift=True)
    list(complete(full, LONG, Sampler(SamplerParams(temp=0)), params, st))
    assert st.n_shifts >= 1 and st.n_gen == n_predict


def test_a_turn_prefills_only_itself(llama: Model) -> None:
    ctx = Context(llama, ContextParams(n_ctx=512))
    st = CompletionStats()
    cache: list[int] = []
    list(complete(ctx, PROMPT, Sampler(SamplerParams(temp=0)), GenerationParams(n_predict=5), st, cache=cache))
    n_past = st.n_past
    st2 = CompletionStats()
    list(complete(ctx, [40, 41, 42], Sampler(SamplerParams(temp=0)), GenerationParams(n_predict=5), st2, cache=cache))
    assert st2.n_prompt == 3 and st2.n_past == n_past + 3 + 4
