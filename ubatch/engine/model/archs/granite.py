"""Granite (3.x, dense): llama's layer with IBM's multipliers: the embedding scaled, attention's
scale given instead of 1/sqrt(head size), each branch scaled before the residual add, the logits
divided."""

from __future__ import annotations

from dataclasses import replace

import gguf

from ubatch.engine.gguf.metadata import meta_float
from ubatch.engine.model.archs import llama
from ubatch.engine.model.archs.base import Arch, Blocks, Config, HFTable, HParams, Meta, T, read_core
from ubatch.engine.model.archs.hf_keys import cfg_num, llama3_rope_freqs, llama_keys


def read_hparams(meta: Meta, source: str, arch: str = "granite") -> HParams:
    """The multipliers under `arch`'s keys (granitemoe has the same ones)."""
    hp = read_core(meta, arch, source)
    attn_scale = meta_float(meta, f"{arch}.attention.scale", source, 0.0)  # 0: llama.cpp's 1/sqrt(head size)
    return replace(
        hp,
        embd_scale=meta_float(meta, f"{arch}.embedding_scale", source, 1.0) or 1.0,
        attn_scale=attn_scale or hp.attn_scale,
        residual_scale=meta_float(meta, f"{arch}.residual_scale", source, 1.0) or 1.0,
        logit_scale=meta_float(meta, f"{arch}.logit_scale", source, positive=True),  # required, as in llama.cpp
    )


def layer(b: Blocks[T], il: int, x: T) -> T:
    """llama's layer with each branch scaled by the residual multiplier before it is added."""
    r = b.hp.residual_scale
    a = b.attention(b.norm(x, il, "attn_norm", f"attn_norm-{il}"), il)
    x = b.residual(x, b.scale(a, r, f"attn_out_scaled-{il}"), il)
    f = b.ffn(b.norm(x, il, "ffn_norm", f"ffn_norm-{il}"), il)
    return b.add(x, b.scale(f, r, f"ffn_out_scaled-{il}"), f"l_out-{il}")


def hf_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The converter's GraniteModel: llama's keys without head_dim, and the multipliers as scales."""
    llama_keys(w, {k: v for k, v in cfg.items() if k != "head_dim"}, src)
    for key, add in (
        ("attention_multiplier", w.add_attention_scale),
        ("embedding_multiplier", w.add_embedding_scale),
        ("residual_multiplier", w.add_residual_scale),
        ("logits_scaling", w.add_logit_scale),
    ):
        if cfg.get(key):
            add(cfg_num(cfg, key, src))


ARCH = Arch(
    name="granite",
    hf_model_types=("granite",),
    read_hparams=read_hparams,
    layer_tensors=llama.layer_tensors,
    layer=layer,
    hf=HFTable(llama.HF_LAYER_NAMES, hf_keys, permute_qk=True, extra_tensors=llama3_rope_freqs),
    chat_template="chatml",
)
