"""An independent, cache-free computation of what embeddings are: the final-norm hidden states
of a full-sequence forward pass (explicit causal / bidirectional and sliding-window masks, no
KV cache, no ubatches), plus tiny llama GGUF files that carry a rank head and the pooling and
attention keys, for tests/test_embedding.py."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
from tiny_models import TinySpec, write_tiny_model

from ubatch.engine.model.model import Model

N_EMBD = 64


def reference_hidden(m: Model, ids: list[int], causal: bool = True) -> torch.Tensor:
    """[n_tokens, n_embd]: what llama.cpp's t_embd holds for one sequence from position 0."""
    hp, n = m.hparams, len(ids)
    x = m.tok_embd.dense()[torch.tensor(ids)] * hp.embd_scale
    pos = torch.arange(n, dtype=torch.float64)

    def rms(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + hp.rms_eps) * w

    def rope(v: torch.Tensor, base: float) -> torch.Tensor:
        d = v.shape[-1]
        th = (pos[:, None] * base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)).float()
        c, s = th.cos()[:, None], th.sin()[:, None]
        if hp.rope_neox:
            a, b = v[..., : d // 2], v[..., d // 2 :]
            return torch.cat([a * c - b * s, a * s + b * c], -1)
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)

    qp, kp = pos[:, None], pos[None, :]
    for il, L in enumerate(m.layers):
        h = rms(x, L.attn_norm)
        q, k, v = (h @ w.dense().T for w in (L.wq, L.wk, L.wv))
        q, k, v = q.view(n, hp.n_head, -1), k.view(n, hp.n_head_kv, -1), v.view(n, hp.n_head_kv, -1)
        if hp.qk_norm:
            q, k = rms(q, L.q_norm), rms(k, L.k_norm)
        base = hp.rope_freq_base_swa if hp.is_swa(il) else hp.rope_freq_base
        q, k = rope(q, base), rope(k, base)
        allowed = (kp <= qp) if causal else torch.ones(n, n, dtype=torch.bool)
        if hp.is_swa(il):
            allowed &= (qp - kp) < hp.n_swa
        r = hp.n_head // hp.n_head_kv
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        att = (torch.einsum("qhd,khd->hqk", q, k) * hp.attn_scale).masked_fill(~allowed[None], -math.inf)
        a = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(n, -1) @ L.wo.dense().T
        x = x + (rms(a, L.post_attn_norm) if hp.sandwich_norm else a)
        h = rms(x, L.ffn_norm)
        g = h @ L.ffn_gate.dense().T
        act = (
            torch.nn.functional.gelu(g, approximate="tanh")
            if hp.ffn_act == "gelu_tanh"
            else torch.nn.functional.silu(g)
        )
        f = (act * (h @ L.ffn_up.dense().T)) @ L.ffn_down.dense().T
        x = x + (rms(f, L.post_ffn_norm) if hp.sandwich_norm else f)
    return rms(x, m.output_norm)


def head_arrays(seed: int = 7) -> dict[str, np.ndarray]:
    """A BERT-style rank head: cls [n_embd, n_embd] + bias, then cls.output [1, n_embd] + bias."""
    rng = np.random.default_rng(seed)
    return {
        "cls.weight": (rng.standard_normal((N_EMBD, N_EMBD)) / 8).astype(np.float32),
        "cls.bias": (0.1 * rng.standard_normal(N_EMBD)).astype(np.float32),
        "cls.output.weight": rng.standard_normal((1, N_EMBD)).astype(np.float32),
        "cls.output.bias": np.array([0.25], dtype=np.float32),
    }


def reference_score(m: Model, ids: list[int], causal: bool = True) -> float:
    """The rank head on the reference's pooled row (the last row when causal, else the first)."""
    h = reference_hidden(m, ids, causal)[-1 if causal else 0].double()
    w = {k: torch.from_numpy(v).double() for k, v in head_arrays().items()}
    z = torch.tanh(w["cls.weight"] @ h + w["cls.bias"])
    return float((w["cls.output.weight"] @ z + w["cls.output.bias"])[0])


def write_llama(path: Path, rank_head: bool = True, causal: bool | None = None, pooling: int | None = None) -> Path:
    """A tiny llama with, optionally, a rank head, attention.causal and pooling_type keys."""

    def extra(w: gguf.GGUFWriter, rng: np.random.Generator) -> None:
        if rank_head:
            for name, arr in head_arrays().items():
                w.add_tensor(name, arr)
        if causal is not None:
            w.add_causal_attention(causal)
        if pooling is not None:
            w.add_pooling_type(gguf.PoolingType(pooling))

    return write_tiny_model(path, TinySpec(arch="llama", n_embd=N_EMBD, extra=extra))
