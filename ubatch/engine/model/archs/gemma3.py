"""Gemma 3 (text): sandwich norms around attention and the FFN, per-head Q/K norms, a GELU-gated
FFN, the embedding scaled by sqrt(n_embd), local sliding-window layers with their own RoPE base
between the global ones."""

from __future__ import annotations

import math
from dataclasses import replace

import gguf

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.metadata import meta_int
from ubatch.engine.model.archs.base import (
    Arch,
    Blocks,
    Config,
    HFTable,
    HParams,
    Meta,
    T,
    TensorSpec,
    attn_tensors,
    ffn_tensors,
    qk_norm_tensors,
    read_core,
    swa_pattern,
)
from ubatch.engine.model.archs.hf_keys import cfg_int, cfg_num, rope_scaling, rope_theta, rope_theta_swa
from ubatch.engine.model.archs.llama import HF_LAYER_NAMES as LLAMA_NAMES

HF_LAYER_NAMES = {k: v for k, v in LLAMA_NAMES.items() if k != "post_attention_layernorm"} | {
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = read_core(meta, "gemma3", source)
    n_swa = meta_int(meta, "gemma3.attention.sliding_window", source, 0, lo=0)
    # the 27B model (62 layers) scales by n_embd / n_head instead of the head size
    scale_by = hp.n_embd / hp.n_head if hp.n_layer == 62 else hp.n_embd_head_k
    return replace(
        hp,
        n_swa=n_swa,
        swa_layers=swa_pattern(meta, "gemma3", hp.n_layer, n_swa, source, 6),
        attn_scale=1.0 / math.sqrt(scale_by),
        embd_scale=math.sqrt(hp.n_embd),
        rope_neox=True,
        sandwich_norm=True,
        qk_norm=True,
        ffn_act="gelu_tanh",
    )


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    d, p = hp.n_embd, f"blk.{il}."
    post = [
        TensorSpec("post_attn_norm", p + "post_attention_norm.weight", (d,), "vector", "replicated"),
        TensorSpec("post_ffn_norm", p + "post_ffw_norm.weight", (d,), "vector", "replicated"),
    ]
    return attn_tensors(hp, il) + ffn_tensors(hp, il) + qk_norm_tensors(hp, il, True) + post


def layer(b: Blocks[T], il: int, x: T) -> T:
    """Attention and FFN each normed before and after, then added to the residual stream."""
    a = b.attention(b.norm(x, il, "attn_norm", f"attn_norm-{il}"), il)
    a = b.norm(a, il, "post_attn_norm", f"attn_post_norm-{il}")
    x = b.residual(x, a, il)
    f = b.ffn(b.norm(x, il, "ffn_norm", f"ffn_norm-{il}"), il)
    f = b.norm(f, il, "post_ffn_norm", f"ffn_post_norm-{il}")
    return b.add(x, f, f"l_out-{il}")


def hf_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The keys the converter's Gemma3Model writes."""
    w.add_block_count(cfg_int(cfg, "num_hidden_layers", src))
    w.add_embedding_length(cfg_int(cfg, "hidden_size", src))
    w.add_feed_forward_length(cfg_int(cfg, "intermediate_size", src))
    rope_scaling(w, cfg, src)
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{src}: attn_logit_softcapping is set; gemma3 has none (a gemma2 config?)")
    head_dim = cfg_int(cfg, "head_dim", src, 256)
    w.add_context_length(cfg_int(cfg, "max_position_embeddings", src, 131072))
    w.add_head_count(cfg_int(cfg, "num_attention_heads", src, 8))
    w.add_layer_norm_rms_eps(cfg_num(cfg, "rms_norm_eps", src, 1e-6))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta(cfg, src) or 1_000_000.0)
    swa_theta = rope_theta_swa(cfg, src)
    if swa_theta is not None:
        w.add_rope_freq_base_swa(swa_theta)
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg_num(cfg, "final_logit_softcapping", src))
    if cfg.get("sliding_window_pattern") != 1:
        w.add_sliding_window(cfg_int(cfg, "sliding_window", src))
    w.add_head_count_kv(cfg_int(cfg, "num_key_value_heads", src, 4))


ARCH = Arch(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=layer,
    hf=HFTable(
        HF_LAYER_NAMES,
        hf_keys,
        norm_shift=True,
        trim_vocab=True,
        space_prefix="never",
        text_config={"gemma3": "gemma3_text"},  # Gemma3ForConditionalGeneration: its text model only
    ),
    chat_template="gemma",
)
