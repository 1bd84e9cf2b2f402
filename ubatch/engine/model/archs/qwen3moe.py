"""Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-Coder): Qwen 3's attention (per-head Q/K norms, NEOX RoPE)
with a mixture of experts in place of every layer's FFN: a softmax router picks the top
`expert_used_count` experts, whose weights llama.cpp always renormalises to sum to one."""

from __future__ import annotations

from dataclasses import replace

from ubatch.engine.model.archs import qwen3
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
    qk_norm_tensors,
    read_core,
    read_moe,
)
from ubatch.engine.model.archs.hf_keys import qwen2moe_keys


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = read_core(meta, "qwen3moe", source)
    return replace(hp, rope_neox=True, qk_norm=True, moe=read_moe(meta, "qwen3moe", source, norm_w=True))


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    return attn_tensors(hp, il) + moe_tensors(hp, il) + qk_norm_tensors(hp, il, True)


def layer(b: Blocks[T], il: int, x: T) -> T:
    """Pre-norm attention, then the pre-normed mixture of experts, each added to the residual."""
    a = b.attention(b.norm(x, il, "attn_norm", f"attn_norm-{il}"), il)
    x = b.residual(x, a, il)
    f = b.moe(b.norm(x, il, "ffn_norm", f"ffn_norm-{il}"), il)
    return b.add(x, f, f"l_out-{il}")


ARCH = Arch(
    name="qwen3moe",
    hf_model_types=("qwen3_moe",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=layer,
    hf=HFTable(qwen3.HF_LAYER_NAMES | {"mlp.gate": "ffn_gate_inp"}, qwen2moe_keys, experts="mlp.experts"),
    chat_template="chatml",
)
