"""Qwen 2 and 2.5: llama's layer with biases on the Q, K and V projections and RoPE on NEOX pairs."""

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
    read_core,
)
from ubatch.engine.model.archs.hf_keys import text_model_keys


def read_hparams(meta: Meta, source: str) -> HParams:
    """The biases need no hparam: the attention block adds those the layer has."""
    return replace(read_core(meta, "qwen2", source), rope_neox=True)


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    dk, dv, p = hp.n_embd_head_k, hp.n_embd_head_v, f"blk.{il}."
    biases = [  # cut with the rows they are added to
        TensorSpec("bq", p + "attn_q.bias", (hp.n_head * dk,), "bias", "q_rows"),
        TensorSpec("bk", p + "attn_k.bias", (hp.n_head_kv * dk,), "bias", "k_rows"),
        TensorSpec("bv", p + "attn_v.bias", (hp.n_head_kv * dv,), "bias", "v_rows"),
    ]
    return attn_tensors(hp, il) + biases + ffn_tensors(hp, il)


ARCH = Arch(
    name="qwen2",
    hf_model_types=("qwen2",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=llama.layer,  # the biases are inside the shared attention block
    hf=HFTable(llama.HF_LAYER_NAMES, text_model_keys),
    chat_template="chatml",
)
