"""Embeddings and reranking from the engine's own forward pass.

llama.cpp pools inside its graph; here the graph of an embedding decode ends at the final norm
(`GraphShape.embd`, every row an output: llama.cpp's `t_embd`) and the few vectors per sequence
that pooling, the rank head and normalisation make are computed from those rows on the host.
This module holds the rank head (the `cls` / `cls.output` tensors), the pooling and normalisation
rules, which prompts a context can embed, and `embed_sequences`, the decode every caller (the
server's engine thread, `Llama.embed`) runs. The model's pooling type and whether it attends
causally are hyperparameters (engine/model/hparams.py); the context resolves them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.errors import ModelLoadError
from ubatch.engine.model.model import Model
from ubatch.kernels.quant.dequant import UnsupportedTypeError, check_supported
from ubatch.kernels.quant.weight import QWeight


@dataclass(frozen=True, slots=True)
class RankHead:
    """llama.cpp's classification head of rank pooling: `cls` (+ bias, then tanh) and
    `cls.output` (+ bias), applied to the pooled row; the score is the first output."""

    cls: torch.Tensor | None
    cls_b: torch.Tensor | None
    out: torch.Tensor | None
    out_b: torch.Tensor | None

    @classmethod
    def from_model(cls, model: Model) -> RankHead | None:
        """The head's tensors, checked against n_embd; None when the model has no rank head."""
        src, tensors, d = str(model.path), model.gguf.tensors, model.hparams.n_embd

        def load(name: str, n_in: int | None) -> torch.Tensor | None:
            t = tensors.get(name)
            if t is None:
                return None
            if (n_in is None and len(t.shape) != 1) or (n_in is not None and t.shape[1:] != (n_in,)):
                want = "a vector" if n_in is None else f"[rows, {n_in}]"
                raise ModelLoadError(f"{src}: tensor {name!r} has shape {t.shape}, expected {want}")
            try:
                check_supported(t.ggml_type, f"{src}: tensor {name!r}")
            except UnsupportedTypeError as e:
                raise ModelLoadError(str(e)) from None
            return QWeight(name, torch.from_numpy(t.data), t.ggml_type, t.shape).dense(torch.float32)

        w = load("cls.weight", d)
        out = load("cls.output.weight", d if w is None else w.shape[0])
        if w is None and out is None:
            return None
        head = cls(w, load("cls.bias", None), out, load("cls.output.bias", None))
        for bias, m in ((head.cls_b, head.cls), (head.out_b, head.out)):
            if bias is not None and (m is None or bias.shape[0] != m.shape[0]):
                raise ModelLoadError(f"{src}: a rank-head bias does not match its matrix")
        return head

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cls is not None:
            x = self.cls @ x
            x = torch.tanh(x + self.cls_b if self.cls_b is not None else x)
        if self.out is not None:
            x = self.out @ x
            if self.out_b is not None:
                x = x + self.out_b
        return x


def pool(rows: torch.Tensor, pooling: str, causal: bool, head: RankHead | None = None) -> torch.Tensor:
    """One sequence's hidden states [n_tokens, n_embd] (in position order) -> its pooled vector
    (or, for none, the rows themselves). Rank reads the first row, or the last when causal."""
    if pooling == "none":
        return rows
    if pooling == "mean":
        return rows.mean(0)
    if pooling == "cls":
        return rows[0]
    if pooling == "last":
        return rows[-1]
    x = rows[-1] if causal else rows[0]
    return head(x) if head is not None else x


def normalize(v: torch.Tensor, embd_norm: int) -> torch.Tensor:
    """llama.cpp's embd_normalize: -1 none, 0 max-abs scaled to the int16 range, 2 Euclidean,
    any other p the p-norm (1 = taxicab); a zero vector stays zero."""
    x = v.double()
    if embd_norm == -1:
        return v.float()
    if embd_norm == 0:
        s = x.abs().max().item() / 32760.0 if x.numel() else 0.0
    elif embd_norm == 2:
        s = math.sqrt(float((x * x).sum()))
    else:
        s = float(x.abs().pow(embd_norm).sum()) ** (1.0 / embd_norm)
    return (x * (1.0 / s if s > 0 else 0.0)).float()


def can_split(pooling: str, causal: bool) -> bool:
    """llama-server's can_split: only a pooling that reads the last token (last, or rank with
    causal attention) may spread a prompt over several decodes; the others need it in one ubatch."""
    return pooling == "last" or (pooling == "rank" and causal)


def fits_together(ctx: Context, lengths: list[int]) -> bool:
    """Whether prompts of these lengths can share one embedding decode: at most n_batch rows;
    without causal attention each sequence must also lie whole in the one ubatch it shares,
    so at most n_ubatch rows and, with a stream per sequence, prompts of equal length."""
    cp = ctx.cparams
    if len(lengths) > 1 and sum(lengths) > cp.n_batch:
        return False
    if cp.causal_attn or len(lengths) == 1:
        return True
    return sum(lengths) <= cp.n_ubatch and (ctx.memory.n_stream == 1 or len(set(lengths)) == 1)


def embed_sequences(ctx: Context, seqs: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
    """The final-norm hidden states [n_tokens, n_embd] of each (seq_id, prompt), evaluated from
    position 0 in decodes of at most n_batch rows (a longer prompt, which only causal attention
    allows, continues through the KV cache). The sequences' cells are freed afterwards."""
    for s, _ in seqs:
        ctx.memory.seq_rm(s)
    rows: dict[int, list[torch.Tensor]] = {s: [] for s, _ in seqs}
    owner: list[int] = []
    batch = Batch()

    def flush() -> None:
        ctx.decode(batch)
        who = np.asarray(owner)
        for s in dict.fromkeys(owner):
            rows[s].append(ctx.embd[torch.from_numpy(np.flatnonzero(who == s))].clone())
        owner.clear()

    was = ctx.embeddings
    ctx.embeddings = True
    try:
        for s, toks in seqs:
            for j, t in enumerate(toks):
                batch.add(t, j, s, True)
                owner.append(s)
                if batch.n_tokens == ctx.cparams.n_batch:
                    flush()
                    batch = Batch()
        if batch.n_tokens:
            flush()
    finally:
        ctx.embeddings = was
        for s, _ in seqs:
            ctx.memory.seq_rm(s)
    return [torch.cat(rows[s]) for s, _ in seqs]


def embed_prompts(ctx: Context, prompts: list[list[int]], embd_norm: int = 2) -> list[torch.Tensor]:
    """Each prompt's pooled vector (its normalised rows with pooling none), on sequence ids
    0..n_seq_max-1, as few prompts per decode as `fits_together` allows (Llama.embed)."""
    head = RankHead.from_model(ctx.model) if ctx.pooling == "rank" else None
    out: list[torch.Tensor] = []
    i = 0
    while i < len(prompts):
        pack = [prompts[i]]
        i += 1
        while i < len(prompts) and len(pack) < ctx.cparams.n_seq_max:
            if not fits_together(ctx, [len(p) for p in (*pack, prompts[i])]):
                break
            pack.append(prompts[i])
            i += 1
        for rows in embed_sequences(ctx, list(enumerate(pack))):
            v = pool(rows, ctx.pooling, ctx.cparams.causal_attn, head)
            out.append(torch.stack([normalize(r, embd_norm) for r in v]) if v.dim() == 2 else normalize(v, embd_norm))
    return out
