"""Verifying a draft: the target's rows for [sampled, d1, ..., dk], decoded in one batch, turned
into the tokens the target accepts.

Row i holds the target's logits after d_i (row 0: after the sampled token). Each row is sampled
by the sequence's own `Generation` exactly as without speculation, so stop strings, n_predict,
grammars and log-probs behave the same and greedy output is identical token for token:
  - sample and match (greedy drafts, or any chain that is not a plain dist draw): sample row i;
    if it equals d_{i+1} keep going, else stop; a fully accepted draft gives one bonus token;
  - rejection sampling (--spec-draft-sampling probabilistic with a dist chain): accept d_{i+1}
    with probability min(1, p/q), else draw from max(0, p - q) renormalised, which leaves the
    output distributed as the target's.
The cells after the last accepted token are removed from the target's cache (`seq_rm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ubatch.engine.generation.generation import Generation, Step
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.sampling.chain import Sampler
from ubatch.engine.spec.speculative import Draft


@dataclass(slots=True)
class Verified:
    steps: list[Step]  # the target's tokens, in order (the last one is not in the cache yet)
    n_drafted: int
    n_accepted: int


def rejection_choice(sampler: Sampler, x: torch.Tensor, token: int, q: dict[int, float]) -> int | None:
    """The rejection rule for one drafted token; None when the chain has no plain distribution."""
    dist = sampler.distribution(x)
    if dist is None:
        return None
    ids, p = dist
    hit = torch.nonzero(ids == token)
    p_tok = float(p[hit[0, 0]]) if hit.numel() else 0.0
    q_tok = q.get(token, 0.0)
    if q_tok > 0 and sampler.rng.uniform() * q_tok < p_tok:
        return token
    # q over the chain's candidates, vectorised: the draft has at most its top 10, the chain may
    # keep the whole vocabulary
    q_tok_ids = torch.tensor(list(q), dtype=ids.dtype)
    q_vals = torch.tensor(list(q.values()), dtype=torch.float64)
    q_ids = ((ids.unsqueeze(1) == q_tok_ids).double() * q_vals).sum(1)
    residual = torch.clamp(p - q_ids, min=0.0)
    weights = residual if float(residual.sum()) > 0 else p
    cum = torch.cumsum(weights, 0)
    u = sampler.rng.uniform() * float(cum[-1])
    i = int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64)))
    return int(ids[min(i, ids.numel() - 1)])


def verify(gen: Generation, rows: torch.Tensor, draft: Draft, memory: KVMemory, seq_id: int) -> Verified:
    """Accept the longest prefix of `draft` the target agrees with. The caller has decoded
    [gen.sampled, *draft.tokens] at consecutive positions and called `gen.decoded()` for the
    first row; afterwards the cache holds exactly the accepted tokens and gen.sampled is the
    next token to decode, as after a plain step."""
    k = len(draft.tokens)
    reject = bool(draft.q) and gen.grammar is None
    steps: list[Step] = []
    n_acc = 0
    for i in range(k + 1):
        choose = None
        if reject and i < k:
            d, q = draft.tokens[i], draft.q[i]
            choose = lambda x, d=d, q=q: _or_sample(gen.sampler, x, d, q)  # noqa: E731
        step = gen.sample(rows[i], choose)
        steps.append(step)
        if i == k or step.token != draft.tokens[i]:
            break
        n_acc += 1
        if step.done:
            break
        gen.decoded()  # the drafted token's K/V are already in its cell
    memory.seq_rm(seq_id, len(gen.cache), -1)
    return Verified(steps, k, n_acc)


def _or_sample(sampler: Sampler, x: torch.Tensor, token: int, q: dict[int, float]) -> int:
    tok = rejection_choice(sampler, x, token, q)
    return sampler.sample(x) if tok is None else tok
