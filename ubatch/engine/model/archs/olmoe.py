"""OLMoE: llama's pre-norm layer with Q and K normed over the whole projection (as OLMo 2, so -tp
cannot split them), RoPE on NEOX pairs, and a mixture of experts (softmax router, the chosen
weights not renormalised) in place of the FFN."""

from __future__ import annotations

from dataclasses import replace

import gguf

from ubatch.engine.model.archs import qwen3, qwen3moe
from ubatch.engine.model.archs.base import (
    Arch,
    Config,
    HFTable,
    HParams,
    Meta,
    TensorSpec,
    attn_tensors,
    moe_tensors,
    read_core,
    read_moe,
)
from ubatch.engine.model.archs.hf_keys import moe_keys, text_model_keys


def hf_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The converter's OlmoeModel: a plain decoder's keys and the experts', the norms' epsilon
    written as 1e-5 whatever the config says."""
    text_model_keys(w, {**cfg, "rms_norm_eps": 1e-5}, src)
    moe_keys(w, cfg, src)


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = read_core(meta, "olmoe", source)
    moe = read_moe(meta, "olmoe", source, norm_w=False, n_ff=hp.n_ff)
    return replace(hp, rope_neox=True, qk_norm_full=True, moe=moe)


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    dk, p = hp.n_embd_head_k, f"blk.{il}."
    norms = [
        TensorSpec("q_norm", p + "attn_q_norm.weight", (hp.n_head * dk,), "vector", "none"),
        TensorSpec("k_norm", p + "attn_k_norm.weight", (hp.n_head_kv * dk,), "vector", "none"),
    ]
    return attn_tensors(hp, il) + norms + moe_tensors(hp, il)


ARCH = Arch(
    name="olmoe",
    hf_model_types=("olmoe",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=qwen3moe.layer,  # pre-norm attention and experts; the norms of Q and K are inside attention
    hf=HFTable(qwen3.HF_LAYER_NAMES | {"mlp.gate": "ffn_gate_inp"}, hf_keys, experts="mlp.experts"),
    chat_template="chatml",
)
