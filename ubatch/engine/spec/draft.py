"""The drafters: prompt lookup over the sequence's own tokens, and a small draft model; and
`create_speculator`, which builds a context's `Speculator` from them.

`NgramSimple` needs no second model: the last `size_n` tokens (the sampled one included) are
looked up earlier in the sequence, and what followed them there is the draft. `DraftModel`
decodes in a context of its own (its own KV cache, the target's n_ctx and sequence count): it
keeps each sequence's cells in step with the target's tokens by their common prefix, so a
rejected draft or a context shift costs only the cells that differ.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ubatch.engine.batch import Batch, RowKind, common_prefix
from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.spec.speculative import Draft, Drafter, SpecError, SpecParams, Speculator

DRAFT_TOP_K = 10  # llama.cpp's draft sampler keeps the 10 best candidates


def check_vocab(target: Model, draft: Model) -> None:
    """Draft and target must mean the same thing by each token id (llama.cpp's compatibility
    check: same size, same special tokens, same token texts)."""
    tv, dv = target.vocab, draft.vocab
    if tv.n_tokens != dv.n_tokens:
        raise SpecError(
            f"the draft model's vocabulary has {dv.n_tokens} tokens but the target's has {tv.n_tokens}; "
            "use a draft model of the same family (same tokenizer)"
        )
    if (tv.bos, tv.eos) != (dv.bos, dv.eos) or tv.add_bos != dv.add_bos:
        raise SpecError(
            "the draft model's special tokens (BOS/EOS) differ from the target's; use a draft model with the same tokenizer"
        )
    bad = next((i for i in range(tv.n_tokens) if tv.token_text(i) != dv.token_text(i)), -1)
    if bad >= 0:
        raise SpecError(
            f"the draft model's token {bad} is {dv.token_text(bad)!r} but the target's is {tv.token_text(bad)!r}; "
            "use a draft model with the same tokenizer"
        )


class NgramSimple:
    """llama.cpp's ngram-simple: find the latest earlier occurrence of the last size_n tokens and
    propose the (up to size_m) tokens that followed it; nothing when fewer than size_n follow."""

    name = "ngram-simple"

    def __init__(self, size_n: int, size_m: int) -> None:
        self.size_n, self.size_m = size_n, size_m
        self.n_max = size_m

    def draft(self, seq_id: int, tokens: list[int], sampled: int, n_max: int) -> Draft:
        n, cur = self.size_n, len(tokens)
        if cur <= n + self.size_m + 1:
            return Draft([])
        hist = np.asarray(tokens, dtype=np.int64)
        pattern = np.append(hist[cur - n + 1 :], sampled)
        windows = np.lib.stride_tricks.sliding_window_view(hist[: cur - 1], n)[1 : cur - n]
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size == 0:
            return Draft([])
        match = int(hits[-1]) + 1  # the latest occurrence before the current one (never position 0)
        n_copy = min(self.size_m, cur - (match + n))
        if n_copy < n:
            return Draft([])
        return Draft(hist[match + n : match + n + min(n_copy, n_max)].tolist())

    def forget(self, seq_id: int) -> None:
        pass


class DraftModel:
    """llama.cpp's draft-simple: greedy (or sampled) tokens from the draft model's top 10, stopping
    when the best candidate's probability falls below p_min."""

    name = "draft-simple"

    def __init__(self, ctx: Context, params: SpecParams) -> None:
        self.ctx, self.p_min, self.probabilistic = ctx, params.p_min, params.probabilistic
        self.n_max = params.n_max
        self.cached: dict[int, list[int]] = {}  # per sequence: the tokens the draft's cells hold
        self.rng = random.Random(0)
        self.n_decode = 0  # draft-context decodes (prefill chunks and drafted tokens)

    def _sync(self, seq_id: int, want: list[int]) -> None:
        """Make the draft's cells of seq_id hold `want`, decoding only what differs; the last
        token is always decoded so its logits are there to draft from."""
        have = self.cached.get(seq_id, [])
        n = min(common_prefix(have, want), len(want) - 1)
        mem = self.ctx.memory
        if n < len(have) - (self.n_max + 1) and not mem.can_shift:
            n = 0  # a sliding-window cache cannot step back further than a draft: start over
        mem.seq_rm(seq_id, n if n > 0 else -1, -1)
        self.cached[seq_id] = want[:n]
        self.ctx.prefill(want[n:], n, seq_id)
        self.n_decode += -(-(len(want) - n) // self.ctx.cparams.n_batch)
        self.cached[seq_id] = list(want)

    def draft(self, seq_id: int, tokens: list[int], sampled: int, n_max: int) -> Draft:
        self._sync(seq_id, [*tokens, sampled])
        cached = self.cached[seq_id]
        out: list[int] = []
        q: list[dict[int, float]] = []
        while True:
            top = torch.topk(self.ctx.logits[-1].float(), DRAFT_TOP_K)
            probs = torch.softmax(top.values, -1)
            if probs[0].item() < self.p_min:
                break
            if self.probabilistic:
                pick = self.rng.choices(range(DRAFT_TOP_K), weights=probs.tolist())[0]
                q.append(dict(zip(top.indices.tolist(), probs.tolist())))
            else:
                pick = 0
            tok = int(top.indices[pick])
            out.append(tok)
            if len(out) >= n_max:
                break
            self.ctx.decode(Batch.from_tokens([tok], len(cached), seq_id, kind=RowKind.DRAFTED))
            self.n_decode += 1
            cached.append(tok)
        return Draft(out, q=q)

    def forget(self, seq_id: int) -> None:
        self.ctx.memory.seq_rm(seq_id)
        self.cached.pop(seq_id, None)


def create_speculator(params: SpecParams, target: Context, draft_ctx: Context | None = None) -> Speculator:
    """The drafters `params` asks for, in llama.cpp's order; `draft_ctx` (the draft model's own
    context) is needed by draft-simple and must share the target's vocabulary (`check_vocab`)."""
    params.check()
    drafters: list[Drafter] = []
    for t in params.ordered():
        if t == "ngram-simple":
            drafters.append(NgramSimple(params.ngram_size_n, params.ngram_size_m))
        elif t == "draft-simple":
            if draft_ctx is None:
                raise SpecError("--spec-type draft-simple needs a draft model: give it with -md FILE")
            check_vocab(target.model, draft_ctx.model)
            drafters.append(DraftModel(draft_ctx, params))
    return Speculator(params, drafters)
