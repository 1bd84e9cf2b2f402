"""Teacher-forced scoring, part of the Python API: log-probabilities of every position, and the
KL divergence from a reference's top-k log-probabilities (how llama.cpp's KLD tooling compares
two runs).

Used by the logits tests (tests/test_default_model.py) and scripts/check_logits.py; it drives a
`Context` of the engine directly and uses nothing above the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context


def teacher_forced_logprobs(ctx: Context, ids: list[int], seq_id: int = 0) -> torch.Tensor:
    """log_softmax of the logits at every position of `ids` (row i predicts token i + 1)."""
    n_batch, rows = ctx.cparams.n_batch, []
    ctx.memory.seq_rm(seq_id)
    for i in range(0, len(ids), n_batch):
        ctx.decode(Batch.from_tokens(ids[i : i + n_batch], i, seq_id, all_logits=True))
        rows.append(torch.log_softmax(ctx.logits.float(), dim=-1))
    return torch.cat(rows)


@dataclass(slots=True)
class KLDStats:
    n: int
    kld_top_mean: float  # Σ over the reference's top tokens of p_ref (log p_ref - log p)
    kld_top_max: float
    top1_agree: float


def kld_vs_top(logprobs: torch.Tensor, ref_ids: list[list[int]], ref_lp: list[list[float]]) -> KLDStats:
    ids = torch.tensor(ref_ids, dtype=torch.long)
    lp_ref = torch.tensor(ref_lp, dtype=torch.float64)
    ours = logprobs[: ids.shape[0]].double().gather(1, ids)
    kld = (lp_ref.exp() * (lp_ref - ours)).sum(1)
    top1 = (logprobs[: ids.shape[0]].argmax(1) == ids[:, 0]).double().mean()
    return KLDStats(int(ids.shape[0]), float(kld.mean()), float(kld.max()), float(top1))


@dataclass(slots=True)
class ReferenceText:
    """One text of a logits reference: its token ids, the reference's top-k per position, and
    llama.cpp's own distance from that reference (`lcpp_kld_top32_mean`, `lcpp_top1_agree`, ...)."""

    ids: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    lcpp: dict[str, float]


def load_reference(refdir: Path) -> list[ReferenceText]:
    """tests/refdata's logits_ids.json, logits_ref.jsonl and logits_lcpp_vs_ref.json, joined."""
    texts = json.loads((refdir / "logits_ids.json").read_text())
    rows: dict[int, list[tuple[int, list[int], list[float]]]] = {}  # text -> (position, top ids, top logprobs)
    for line in (refdir / "logits_ref.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["text"], []).append((r["pos"], r["top_ids"], r["top_logprobs"]))
    lcpp = {r["text"]: r for r in json.loads((refdir / "logits_lcpp_vs_ref.json").read_text())}
    out = []
    for t, ids in enumerate(texts):
        rs = sorted(rows[t], key=lambda r: r[0])
        out.append(ReferenceText(ids, [r[1] for r in rs], [r[2] for r in rs], lcpp[t]))
    return out
