"""The forward pass of llama and gemma3 over one ubatch shape, written once as a graph.

`build_forward` records the pass with a GraphBuilder (nothing is computed); the context plans
it into its workspace and runs it with the inputs engine/context/step_inputs.py writes. Every row is
independent except inside attention, which reads other tokens only through the KV cache and
the mask. Names follow llama.cpp's graph (`attn_norm-0`, `Qcur-0`, `ffn_out-17`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ubatch.engine.graph.builder import GraphBuilder
from ubatch.engine.graph.graph import Graph, Sym
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.model.model import Model
from ubatch.kernels.ops import KV_CHUNK, AttentionArgs, MaskCells, Ops


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What a graph's buffers depend on; equal shapes reuse the graph (llama.cpp's can_reuse)."""

    n_tokens: int
    n_outputs: int
    n_groups: tuple[int, ...]  # per cache: KV streams in the ubatch (1 when unified)
    n_kv: tuple[int, ...]  # per cache: cells attention reads, a multiple of 256
    embd: bool = False  # the graph ends at the final norm: hidden states instead of logits


def rope_keys(model: Model) -> list[tuple[float, float]]:
    keys: list[tuple[float, float]] = []
    for il in range(model.hparams.n_layer):
        if model.hparams.rope_params(il) not in keys:
            keys.append(model.hparams.rope_params(il))
    return keys


SEQ_BITS = 64  # sequences one cell's bit set can hold in the kernel's int64
NO_CAUSAL = np.iinfo(np.int32).max  # a query's causal limit where attention is not causal


def mask_in_kernel(ops: Ops, mem: KVMemory) -> bool:
    """Whether attention computes the mask from the cells (the backend can, and every cell's
    sequence set fits in SEQ_BITS bits): then no [n_tokens, n_kv] mask exists in memory."""
    return ops.mask_in_kernel and all(c.n_seq_max <= SEQ_BITS for c in mem.caches)


def _required(w: torch.Tensor | None) -> torch.Tensor:
    """A norm weight the hparams say every layer has (the loader required it)."""
    if w is None:
        raise ValueError("a layer lacks a norm weight its architecture requires")
    return w


def _mask_inputs(b: GraphBuilder, mem: KVMemory, shape: GraphShape, cells: bool) -> list[Sym | MaskCells[Sym]]:
    """Per cache: the kq_mask tensor input, or the cell and query inputs the kernel masks from
    (cell positions and sequence bits per group; the queries' positions, causal limits and
    sequence bits, shared by the caches)."""
    n, pairs = shape.n_tokens, list(zip(shape.n_groups, shape.n_kv))
    if not cells:
        return [b.input(f"kq_mask_{c}", (g, n // g, n_kv), torch.float16) for c, (g, n_kv) in enumerate(pairs)]
    qpos, qlim = b.input("inp_q_pos", (n,), torch.int32), b.input("inp_q_lim", (n,), torch.int32)
    qseq = b.input("inp_q_seq", (n,), torch.int64)
    return [
        MaskCells(
            b.input(f"kv_pos_{c}", (g, n_kv), torch.int32),
            b.input(f"kv_seq_{c}", (g, n_kv), torch.int64),
            qpos,
            qseq,
            mem.caches[c].n_swa,
            qlim,
        )
        for c, (g, n_kv) in enumerate(pairs)
    ]


def build_forward(model: Model, mem: KVMemory, shape: GraphShape, ops: Ops) -> Graph:
    hp, b = model.hparams, GraphBuilder(ops)
    n, n_out = shape.n_tokens, shape.n_outputs
    tokens = b.input("inp_tokens", (n,), torch.int64)
    ropes: dict[tuple[float, float], tuple[Sym, Sym]] = {}
    for i, key in enumerate(rope_keys(model)):
        ropes[key] = (b.input(f"inp_cos_{i}", (n, hp.n_rot // 2)), b.input(f"inp_sin_{i}", (n, hp.n_rot // 2)))
    masks = _mask_inputs(b, mem, shape, mask_in_kernel(ops, mem))
    slots = [b.input(f"kv_idxs_{c}", (n,), torch.int64) for c in range(len(mem.caches))]
    # per cache: the first cell of each group's stream, and which 256-cell chunks any query sees
    starts = [b.input(f"kv_starts_{c}", (g,), torch.int64) for c, g in enumerate(shape.n_groups)]
    visible = [b.input(f"kv_visible_{c}", (n_kv // KV_CHUNK,), torch.bool) for c, n_kv in enumerate(shape.n_kv)]
    out_ids = b.input("inp_out_ids", (n_out,), torch.int64) if n_out < n else None

    tp = model.shard  # tensor parallelism: one all-reduce after each row-split product pair
    x = b.get_rows(model.tok_embd, tokens, "inp_embd")
    if tp is not None:  # each rank looked up the ids of its vocabulary slice, zeros for the rest
        x = b.all_reduce(x, tp.comm, "inp_embd_sum")
    if hp.embd_scale != 1.0:
        x = b.scale(x, hp.embd_scale, "inp_scaled")
    for il, L in enumerate(model.layers):
        ci = mem.layer_cache[il]
        cache, g, n_kv = mem.caches[ci], shape.n_groups[ci], shape.n_kv[ci]
        h = b.rms_norm(x, L.attn_norm, hp.rms_eps, f"attn_norm-{il}")
        q = b.view(b.linear(h, L.wq, f"Qcur-{il}"), (n, hp.n_head, hp.n_embd_head_k))
        k = b.view(b.linear(h, L.wk, f"Kcur-{il}"), (n, hp.n_head_kv, hp.n_embd_head_k))
        v = b.view(b.linear(h, L.wv, f"Vcur-{il}"), (n, hp.n_head_kv, hp.n_embd_head_v))
        if hp.qk_norm:
            q = b.rms_norm(q, _required(L.q_norm), hp.rms_eps, f"Qcur_normed-{il}")
            k = b.rms_norm(k, _required(L.k_norm), hp.rms_eps, f"Kcur_normed-{il}")
        cos, sin = ropes[hp.rope_params(il)]
        q = b.scale(b.rope(q, cos, sin, hp.rope_neox, f"Qcur_rope-{il}"), hp.attn_scale, f"Qcur_scaled-{il}")
        k = b.rope(k, cos, sin, hp.rope_neox, f"Kcur_rope-{il}")
        ks = b.kv_store(cache.k[il], slots[ci], k, f"k_store-{il}")
        vs = b.kv_store(cache.v[il], slots[ci], v, f"v_store-{il}")
        qg = b.view(q, (g, n // g, hp.n_head, hp.n_embd_head_k))
        m = masks[ci]
        cells, mask = (m, None) if isinstance(m, MaskCells) else (None, m)
        att = AttentionArgs(qg, cache.k[il], cache.v[il], starts[ci], n_kv, mask, 1.0, visible[ci], cells)
        a = b.attention(att, (ks, vs), f"kqv_out-{il}")
        a = b.linear(a, L.wo, f"attn_out-{il}")
        if tp is not None:
            a = b.all_reduce(a, tp.comm, f"attn_out_sum-{il}")
        if hp.sandwich_norm:
            a = b.rms_norm(a, _required(L.post_attn_norm), hp.rms_eps, f"attn_post_norm-{il}")
        if il == hp.n_layer - 1 and out_ids is not None:  # only output rows pay for the rest
            x = b.rows(x, out_ids, f"inpSA_out-{il}")
            a = b.rows(a, out_ids, f"attn_out_rows-{il}")
        x = b.add(x, a, f"ffn_inp-{il}")
        h = b.rms_norm(x, L.ffn_norm, hp.rms_eps, f"ffn_norm-{il}")
        f = b.glu(
            b.linear(h, L.ffn_gate, f"ffn_gate-{il}"),
            b.linear(h, L.ffn_up, f"ffn_up-{il}"),
            hp.ffn_act,
            f"ffn_glu-{il}",
        )
        f = b.linear(f, L.ffn_down, f"ffn_out-{il}")
        if tp is not None:
            f = b.all_reduce(f, tp.comm, f"ffn_out_sum-{il}")
        if hp.sandwich_norm:
            f = b.rms_norm(f, _required(L.post_ffn_norm), hp.rms_eps, f"ffn_post_norm-{il}")
        x = b.add(x, f, f"l_out-{il}")
    if hp.n_layer == 0 and out_ids is not None:
        x = b.rows(x, out_ids, "inp_out_rows")
    x = b.rms_norm(x, model.output_norm, hp.rms_eps, "result_norm")
    if shape.embd:  # embeddings (llama.cpp's t_embd): pooling reads these rows (engine/generation/embedding.py)
        return b.finish(x)
    logits = b.linear(x, model.output, "result_output")
    if hp.final_logit_softcap:
        logits = b.softcap(logits, hp.final_logit_softcap, "result_softcap")
    if tp is not None:  # this rank's vocabulary slice; rank 0 samples from all of them
        logits = b.gather_cols(logits, tp.comm, hp.n_vocab, "result_gather")
    return b.finish(logits)
