"""Gemma 2: gemma3's sandwich-normed layer without Q/K norms, attention scores and the final
logits soft-capped (c·tanh(x / c)), sliding-window attention on every other layer (the first of
each pair) with one RoPE base."""

from __future__ import annotations

import math
from dataclasses import replace

import gguf

from ubatch.engine.gguf.metadata import meta_float, meta_int
from ubatch.engine.model.archs import gemma3
from ubatch.engine.model.archs.base import (
    Arch,
    Config,
    HFTable,
    HParams,
    Meta,
    TensorSpec,
    attn_tensors,
    ffn_tensors,
    read_core,
    swa_pattern,
)
from ubatch.engine.model.archs.hf_keys import cfg_int, cfg_num

HF_LAYER_NAMES = {
    k: v for k, v in gemma3.HF_LAYER_NAMES.items() if not k.startswith(("self_attn.q_norm", "self_attn.k_norm"))
}


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = read_core(meta, "gemma2", source)
    n_swa = meta_int(meta, "gemma2.attention.sliding_window", source, 4096, lo=0)
    # the 27B model (46 layers) scales by n_embd / n_head instead of the head size (llama.cpp)
    scale_by = hp.n_embd / hp.n_head if hp.n_layer == 46 else hp.n_embd_head_k
    return replace(
        hp,
        n_swa=n_swa,
        swa_layers=swa_pattern(meta, "gemma2", hp.n_layer, n_swa, source, 2),
        attn_scale=1.0 / math.sqrt(scale_by),
        embd_scale=math.sqrt(hp.n_embd),
        rope_neox=True,
        sandwich_norm=True,
        ffn_act="gelu_tanh",
        # llama.cpp's defaults where the keys are absent
        attn_softcap=meta_float(meta, "gemma2.attn_logit_softcapping", source, 50.0, positive=True),
        final_logit_softcap=meta_float(meta, "gemma2.final_logit_softcapping", source, 30.0, positive=True),
    )


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    d, p = hp.n_embd, f"blk.{il}."
    post = [
        TensorSpec("post_attn_norm", p + "post_attention_norm.weight", (d,), "vector", "replicated"),
        TensorSpec("post_ffn_norm", p + "post_ffw_norm.weight", (d,), "vector", "replicated"),
    ]
    return attn_tensors(hp, il) + ffn_tensors(hp, il) + post


def hf_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The keys the converter's Gemma2Model writes."""
    w.add_context_length(cfg_int(cfg, "max_position_embeddings", src, 8192))
    w.add_embedding_length(cfg_int(cfg, "hidden_size", src))
    w.add_block_count(cfg_int(cfg, "num_hidden_layers", src))
    w.add_feed_forward_length(cfg_int(cfg, "intermediate_size", src))
    w.add_head_count(cfg_int(cfg, "num_attention_heads", src))
    w.add_head_count_kv(cfg_int(cfg, "num_key_value_heads", src))
    w.add_layer_norm_rms_eps(cfg_num(cfg, "rms_norm_eps", src))
    head_dim = cfg_int(cfg, "head_dim", src)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_attn_logit_softcapping(cfg_num(cfg, "attn_logit_softcapping", src))
    w.add_final_logit_softcapping(cfg_num(cfg, "final_logit_softcapping", src))
    w.add_sliding_window(cfg_int(cfg, "sliding_window", src))


ARCH = Arch(
    name="gemma2",
    hf_model_types=("gemma2",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=gemma3.layer,  # the same sandwich; soft-capping is the attention block's
    hf=HFTable(HF_LAYER_NAMES, hf_keys, norm_shift=True, trim_vocab=True, space_prefix="never"),
    chat_template="gemma",
)
