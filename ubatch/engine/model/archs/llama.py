"""Llama (and the files written as `llama`: Llama 3.x, Mistral, SmolLM2, ...): RMS pre-norms, RoPE
on interleaved pairs (linear scaling, or llama3's as the `rope_freqs` tensor that divides each
pair's frequency), a SiLU-gated FFN, the output tied to the embedding or its own."""

from __future__ import annotations

from ubatch.engine.errors import ModelLoadError
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
from ubatch.engine.model.archs.hf_keys import llama3_rope_freqs, llama_keys

# HF module under model.layers.N -> GGUF stem under blk.N, as the converter maps them
HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = read_core(meta, "llama", source)
    if hp.n_rot != hp.n_embd_head_k:
        raise ModelLoadError(f"{source}: llama requires rope.dimension_count == head size")
    return hp


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    return attn_tensors(hp, il) + ffn_tensors(hp, il)


def layer(b: Blocks[T], il: int, x: T) -> T:
    """Pre-norm attention and FFN, each added to the residual stream."""
    a = b.attention(b.norm(x, il, "attn_norm", f"attn_norm-{il}"), il)
    x = b.residual(x, a, il)
    f = b.ffn(b.norm(x, il, "ffn_norm", f"ffn_norm-{il}"), il)
    return b.add(x, f, f"l_out-{il}")


ARCH = Arch(
    name="llama",
    hf_model_types=("llama",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=layer,
    hf=HFTable(HF_LAYER_NAMES, llama_keys, permute_qk=True, space_prefix="config", extra_tensors=llama3_rope_freqs),
    chat_template="chatml",
)
