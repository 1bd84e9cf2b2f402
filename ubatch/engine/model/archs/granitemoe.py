"""Granite MoE (granite-3.x-1b-a400m, -3b-a800m; GraniteMoeShared): Granite's multipliers
(embedding, attention scale, residual, logits) with a mixture of experts in place of the FFN: a
softmax router, the top-k weights renormalised, the experts `feed_forward_length` wide, and
shared experts beside them where the file has `expert_shared_feed_forward_length`."""

from __future__ import annotations

from dataclasses import replace

from ubatch.engine.model.archs import granite
from ubatch.engine.model.archs.base import (
    Arch,
    Blocks,
    HFTable,
    HParams,
    Meta,
    T,
    TensorSpec,
    attn_tensors,
    moe_tensors,
    read_moe,
    shexp_tensors,
)
from ubatch.engine.model.archs.hf_keys import text_model_keys

NAME = "granitemoe"


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = granite.read_hparams(meta, source, NAME)
    return replace(hp, moe=read_moe(meta, NAME, source, norm_w=True, gating="softmax", n_ff=hp.n_ff))


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    assert hp.moe is not None
    shared = shexp_tensors(hp, il) if hp.moe.n_ff_shexp else []
    return attn_tensors(hp, il) + moe_tensors(hp, il) + shared


HF_REFUSED = (
    "-m DIR does not read Granite MoE checkpoints (each layer's experts in one fused input_linear); "
    "convert it with llama.cpp's convert_hf_to_gguf.py and pass the .gguf"
)


def layer(b: Blocks[T], il: int, x: T) -> T:
    """Granite's layer with the mixture of experts (and its shared experts) as the FFN branch."""
    r = b.hp.residual_scale
    a = b.attention(b.norm(x, il, "attn_norm", f"attn_norm-{il}"), il)
    x = b.residual(x, b.scale(a, r, f"attn_out_scaled-{il}"), il)
    f = b.moe(b.norm(x, il, "ffn_norm", f"ffn_norm-{il}"), il)
    return b.add(x, b.scale(f, r, f"ffn_out_scaled-{il}"), f"l_out-{il}")


ARCH = Arch(
    name=NAME,
    hf_model_types=("granitemoe", "granitemoeshared"),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=layer,
    hf=HFTable({}, text_model_keys, refused=HF_REFUSED),
    chat_template="chatml",
)
