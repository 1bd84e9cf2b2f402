"""OLMo 2: no pre-norms; attention and FFN outputs normed before the residual add, Q and K
normed over the whole projection (all heads at once, so -tp cannot split them), RoPE on NEOX
pairs."""

from __future__ import annotations

from dataclasses import replace

from ubatch.engine.model.archs.base import (
    Arch,
    Blocks,
    HFTable,
    HParams,
    Meta,
    T,
    TensorSpec,
    attn_tensors,
    ffn_tensors,
    read_core,
)
from ubatch.engine.model.archs.hf_keys import text_model_keys
from ubatch.engine.model.archs.llama import HF_LAYER_NAMES as LLAMA_NAMES

HF_LAYER_NAMES = {k: v for k, v in LLAMA_NAMES.items() if k not in ("input_layernorm", "post_attention_layernorm")} | {
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def read_hparams(meta: Meta, source: str) -> HParams:
    return replace(read_core(meta, "olmo2", source), rope_neox=True, qk_norm_full=True)


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    d, dk, p = hp.n_embd, hp.n_embd_head_k, f"blk.{il}."
    pre = ("attn_norm", "ffn_norm")
    own = [
        TensorSpec("q_norm", p + "attn_q_norm.weight", (hp.n_head * dk,), "vector", "none"),
        TensorSpec("k_norm", p + "attn_k_norm.weight", (hp.n_head_kv * dk,), "vector", "none"),
        TensorSpec("post_attn_norm", p + "post_attention_norm.weight", (d,), "vector", "replicated"),
        TensorSpec("post_ffn_norm", p + "post_ffw_norm.weight", (d,), "vector", "replicated"),
    ]
    return [t for t in attn_tensors(hp, il) + ffn_tensors(hp, il) if t.field not in pre] + own


def layer(b: Blocks[T], il: int, x: T) -> T:
    """Attention and FFN read the residual stream itself; their outputs are normed, then added."""
    a = b.norm(b.attention(x, il), il, "post_attn_norm", f"attn_post_norm-{il}")
    x = b.residual(x, a, il)
    f = b.norm(b.ffn(x, il), il, "post_ffn_norm", f"ffn_post_norm-{il}")
    return b.add(x, f, f"l_out-{il}")


ARCH = Arch(
    name="olmo2",
    hf_model_types=("olmo2",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=layer,
    hf=HFTable(HF_LAYER_NAMES, text_model_keys),
    chat_template="chatml",
)
