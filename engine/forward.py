"""The forward pass of llama and gemma3 over one ubatch, against the KV cache.

Written once as plain calls to `kernels.Ops`, so the same code runs on any backend. Every row
is independent except inside attention, which reads other tokens only through the cache and
its mask.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.ops import Ops
from .batch import UBatch
from .memory import KVMemory
from .model import Model


def forward(model: Model, ops: Ops, ub: UBatch, mem: KVMemory, slots: list[np.ndarray],
            out_rows: np.ndarray) -> torch.Tensor:
    """Logits [len(out_rows), n_vocab] for the ubatch rows `out_rows`.

    `slots[c]` are the cells the ubatch occupies in cache c (already applied to its cells).
    """
    hp, dev = model.hparams, model.device
    n = ub.n_tokens
    tokens = torch.from_numpy(ub.token).to(dev)
    pos = torch.from_numpy(ub.pos).to(dev)
    x = ops.get_rows(model.tok_embd, tokens)
    if hp.embd_scale != 1.0:
        x = x * hp.embd_scale

    ropes: dict[tuple[float, float], tuple[torch.Tensor, torch.Tensor]] = {}
    for il in range(hp.n_layer):
        key = hp.rope_params(il)
        if key not in ropes:
            ropes[key] = ops.rope_cache(pos, hp.n_rot, key[0], key[1], model.rope_freqs)
    streams = [c.ubatch_streams(ub) for c in mem.caches]
    n_kvs = [c.n_kv_of(st) for c, st in zip(mem.caches, streams)]
    masks = [c.mask(ub, st, n_kv, dev) for c, st, n_kv in zip(mem.caches, streams, n_kvs)]
    slot_idx = [torch.from_numpy(s).to(dev) for s in slots]

    for il, L in enumerate(model.layers):
        ci = mem.layer_cache[il]
        cache = mem.caches[ci]
        h = ops.rms_norm(x, L.attn_norm, hp.rms_eps)
        q = ops.linear(h, L.wq).view(n, hp.n_head, hp.n_embd_head_k)
        k = ops.linear(h, L.wk).view(n, hp.n_head_kv, hp.n_embd_head_k)
        v = ops.linear(h, L.wv).view(n, hp.n_head_kv, hp.n_embd_head_v)
        if hp.qk_norm:
            q = ops.rms_norm(q, L.q_norm, hp.rms_eps)
            k = ops.rms_norm(k, L.k_norm, hp.rms_eps)
        cos, sin = ropes[hp.rope_params(il)]
        q = ops.rope(q, cos, sin, hp.rope_neox) * hp.attn_scale
        k = ops.rope(k, cos, sin, hp.rope_neox)
        cache.write(il, slot_idx[ci], k, v)
        kc, vc = cache.kv_rows(il, streams[ci], n_kvs[ci])
        g = len(streams[ci])
        a = ops.attention(q.view(g, n // g, hp.n_head, -1), kc, vc, masks[ci], 1.0)
        a = ops.linear(a, L.wo)
        if hp.sandwich_norm:
            a = ops.rms_norm(a, L.post_attn_norm, hp.rms_eps)
        x = x + a
        if il == hp.n_layer - 1 and len(out_rows) < n:
            x = x[torch.from_numpy(out_rows).to(dev)]  # only output rows pay for the rest
        h = ops.rms_norm(x, L.ffn_norm, hp.rms_eps)
        f = ops.glu(ops.linear(h, L.ffn_gate), ops.linear(h, L.ffn_up), hp.ffn_act)
        f = ops.linear(f, L.ffn_down)
        if hp.sandwich_norm:
            f = ops.rms_norm(f, L.post_ffn_norm, hp.rms_eps)
        x = x + f
    x = ops.rms_norm(x, model.output_norm, hp.rms_eps)
    logits = ops.linear(x, model.output)
    if hp.final_logit_softcap:
        c = hp.final_logit_softcap
        logits = torch.tanh(logits / c) * c
    return logits
