"""Qwen 3 (dense): llama's layer with per-head RMS norms of Q and K before RoPE, RoPE on NEOX
pairs (each head's first half with its second), head width set apart from n_embd / n_head."""

from __future__ import annotations

from dataclasses import replace

from ubatch.engine.model.archs import llama
from ubatch.engine.model.archs.base import (
    Arch,
    HFTable,
    HParams,
    Meta,
    TensorSpec,
    attn_tensors,
    ffn_tensors,
    qk_norm_tensors,
    read_core,
)
from ubatch.engine.model.archs.hf_keys import text_model_keys

HF_LAYER_NAMES = llama.HF_LAYER_NAMES | {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def read_hparams(meta: Meta, source: str) -> HParams:
    return replace(read_core(meta, "qwen3", source), rope_neox=True, qk_norm=True)


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    return attn_tensors(hp, il) + ffn_tensors(hp, il) + qk_norm_tensors(hp, il, True)


ARCH = Arch(
    name="qwen3",
    hf_model_types=("qwen3",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=llama.layer,  # the norms of Q and K are inside the shared attention block
    hf=HFTable(HF_LAYER_NAMES, text_model_keys),
    chat_template="chatml",
)
