"""On the default model: sequences that share ubatches never see each other.

Several sequences of different lengths (one past the 512-token sliding window) are decoded
together, prefill and decode rows mixed and interleaved, and each gets the logits it gets alone.
A prefix decoded once and shared with seq_cp gives the logits of independent runs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams

pytestmark = pytest.mark.slow
TEXTS = json.loads((Path(__file__).parent / "refdata" / "logits_ids.json").read_text())
# f32 KV: an f16 cache rounds K/V computed in a different matmul shape to a different half
# 1 ulp now and then, which this model amplifies to ~0.02 in the logits (~20 in size)
TOL = dict(atol=2e-3, rtol=1e-4)


@pytest.fixture(scope="module")
def model(default_model: Model) -> Model:
    return default_model


_ALONE: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}


def alone(model: Model, prompt: list[int], follow: list[int]) -> torch.Tensor:
    """Logits of the last prompt token, then of each follow-up token, decoding one sequence.
    Computed once per (prompt, follow): both cache layouts are checked against the same rows."""
    key = (id(model), tuple(prompt), tuple(follow))
    if key not in _ALONE:
        _ALONE[key] = _alone(model, prompt, follow)
    return _ALONE[key].clone()


def _alone(model: Model, prompt: list[int], follow: list[int]) -> torch.Tensor:
    ctx = Context(model, ContextParams(n_ctx=2048, type_k="f32", type_v="f32"))
    ctx.decode(Batch.from_tokens(prompt, 0))
    rows = [ctx.logits[-1].clone()]  # logits are valid until the next decode
    for i, t in enumerate(follow):
        ctx.decode(Batch.from_tokens([t], len(prompt) + i))
        rows.append(ctx.logits[-1].clone())
    return torch.stack(rows)


@pytest.mark.parametrize("kvu", [True, False], ids=["unified", "streams"])
def test_mixed_prefill_and_decode_rows_match_each_sequence_alone(model: Model, kvu: bool) -> None:
    prompts = [TEXTS[1][:600], TEXTS[0][:40], TEXTS[3][:90], TEXTS[2][:7]]
    follow = [
        [TEXTS[1][600 + i] for i in range(3)],
        [TEXTS[0][40 + i] for i in range(3)],
        [TEXTS[3][90 + i] for i in range(3)],
        [TEXTS[2][7 + i] for i in range(3)],
    ]
    ctx = Context(
        model, ContextParams(n_ctx=4096, n_seq_max=4, kv_unified=kvu, n_ubatch=512, type_k="f32", type_v="f32")
    )
    # seq 0 is already long (past the window) before the others start
    ctx.decode(Batch.from_tokens(prompts[0], 0, seq_id=0))
    got: dict[int, list[torch.Tensor]] = {0: [ctx.logits[-1].clone()], 1: [], 2: [], 3: []}
    rng = random.Random(0)
    # one batch: seq 0's first follow-up row (decode) + the prompts of seqs 1..3 (prefill),
    # rows interleaved at random while each sequence keeps its own order
    queues = {0: [(follow[0][0], 600, True)]}
    for s in (1, 2, 3):
        queues[s] = [(t, p, p == len(prompts[s]) - 1) for p, t in enumerate(prompts[s])]
    b = Batch()
    owners = []
    while queues:
        s = rng.choice(sorted(queues))
        t, p, out = queues[s].pop(0)
        b.add(t, p, s, out)
        owners += [s] if out else []
        if not queues[s]:
            del queues[s]
    ctx.decode(b)
    for s, row in zip(owners, ctx.logits):
        got[s].append(row.clone())
    # then decode steps with one row per sequence, rows in shuffled order
    pos = {0: 601, 1: len(prompts[1]), 2: len(prompts[2]), 3: len(prompts[3])}
    step = {0: 1, 1: 0, 2: 0, 3: 0}
    for _ in range(2):
        order = [0, 1, 2, 3]
        rng.shuffle(order)
        b = Batch()
        for s in order:
            b.add(follow[s][step[s]], pos[s], s, True)
            pos[s] += 1
            step[s] += 1
        ctx.decode(b)
        for s, row in zip(order, ctx.logits):
            got[s].append(row.clone())
    for s in range(4):
        ref = alone(model, prompts[s], follow[s][: len(got[s]) - 1])
        torch.testing.assert_close(torch.stack(got[s]), ref, **TOL)


def test_a_shared_prefix_gives_the_logits_of_independent_runs(model: Model) -> None:
    prefix = TEXTS[0][:50]
    conts = [TEXTS[0][50:55], TEXTS[1][10:15], TEXTS[2][20:25], TEXTS[3][30:35]]
    ctx = Context(model, ContextParams(n_ctx=1024, n_seq_max=4, kv_unified=True, type_k="f32", type_v="f32"))
    ctx.decode(Batch.from_tokens(prefix, 0, seq_id=0))
    for s in (1, 2, 3):
        ctx.memory.seq_cp(0, s)
    assert ctx.memory.caches[0].used == 50  # one set of cells, four sequences
    b = Batch()
    for s, c in enumerate(conts):
        for i, t in enumerate(c):
            b.add(t, 50 + i, s, True)
    ctx.decode(b)
    for s, c in enumerate(conts):
        solo = Context(model, ContextParams(n_ctx=1024, type_k="f32", type_v="f32"))
        solo.decode(Batch.from_tokens(prefix + c, 0, all_logits=True))
        torch.testing.assert_close(ctx.logits[5 * s : 5 * s + 5], solo.logits[50:], **TOL)
