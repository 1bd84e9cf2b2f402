"""The forward pass over one ubatch shape, written once as a graph: inputs, embedding, each
layer as its architecture writes it (engine/model/archs), the output head.

`build_forward` records the pass with a GraphBuilder (nothing is computed); the context plans
it into its workspace and runs it with the inputs engine/context/step_inputs.py writes. Every row is
independent except inside attention, which reads other tokens only through the KV cache and
the mask. Names follow llama.cpp's graph (`attn_norm-0`, `Qcur-0`, `ffn_out-17`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ubatch.engine.graph.blocks import GraphBlocks
from ubatch.engine.graph.builder import GraphBuilder
from ubatch.engine.graph.graph import Graph, Sym
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.model.archs import ARCHS
from ubatch.engine.model.lora import OUTPUT_KEY
from ubatch.engine.model.model import Model
from ubatch.kernels.ops import KV_CHUNK, MaskCells, Ops


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What a graph's buffers depend on; equal shapes reuse the graph (llama.cpp's can_reuse)."""

    n_tokens: int
    n_outputs: int
    n_groups: tuple[int, ...]  # per cache: KV streams in the ubatch (1 when unified)
    n_kv: tuple[int, ...]  # per cache: cells attention reads, a multiple of 256
    embd: bool = False  # the graph ends at the final norm: hidden states instead of logits
    lora_slots: int = 0  # the most LoRA adapters one row applies (0: the graph has no LoRA node)
    n_adapters: int = 0  # with lora_slots: the model's adapters the stacks held when it was built


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
    # each row's LoRA adapters (-1 padded) and their scales, read by the segmented kernel
    m = shape.lora_slots
    lora = (b.input("lora_idx", (n, m), torch.int32), b.input("lora_scale", (n, m))) if m else None
    heads = b.input("inp_head_ids", (n, hp.n_head), torch.int32) if hp.mla else None

    tp = model.shard  # tensor parallelism: the blocks all-reduce each row-split product pair
    x = b.get_rows(model.tok_embd, tokens, "inp_embd")
    if tp is not None:  # each rank looked up the ids of its vocabulary slice, zeros for the rest
        x = b.all_reduce(x, tp.comm, "inp_embd_sum")
    if hp.embd_scale != 1.0:
        x = b.scale(x, hp.embd_scale, "inp_scaled")
    blocks = GraphBlocks(
        b, model, mem, n, shape.n_groups, shape.n_kv, ropes, masks, slots, starts, visible, out_ids, lora, heads
    )
    layer = ARCHS[hp.arch].layer  # the architecture's layer, written with the shared blocks
    for il in range(hp.n_layer):
        x = layer(blocks, il, x)
    if hp.n_layer == 0 and out_ids is not None:
        x = b.rows(x, out_ids, "inp_out_rows")
    x = b.rms_norm(x, model.output_norm, hp.rms_eps, "result_norm")
    if shape.embd:  # embeddings (llama.cpp's t_embd): pooling reads these rows (engine/generation/embedding.py)
        return b.finish(x)
    logits = b.linear(x, model.output, "result_output")
    logits = blocks.lora(x, logits, OUTPUT_KEY, "result_output_lora")
    if hp.logit_scale != 1.0:
        logits = b.scale(logits, 1.0 / hp.logit_scale, "result_scaled")
    if hp.final_logit_softcap:
        logits = b.softcap(logits, hp.final_logit_softcap, "result_softcap")
    if tp is not None:  # this rank's vocabulary slice; rank 0 samples from all of them
        logits = b.gather_cols(logits, tp.comm, hp.n_vocab, "result_gather")
    return b.finish(logits)
