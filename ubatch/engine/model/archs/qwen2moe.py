"""Qwen 2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen 2's attention (Q/K/V biases, NEOX RoPE)
with a mixture of experts in place of every FFN: a softmax router whose top-k weights llama.cpp
never renormalises, and beside the routed experts one shared expert whose output is scaled by
the sigmoid of its own gate logit (`ffn_gate_inp_shexp`)."""

from __future__ import annotations

from dataclasses import replace

from ubatch.engine.model.archs import llama, qwen2, qwen3moe
from ubatch.engine.model.archs.base import (
    Arch,
    HFTable,
    HParams,
    Meta,
    TensorSpec,
    moe_tensors,
    read_core,
    read_moe,
    shexp_tensors,
)
from ubatch.engine.model.archs.hf_keys import qwen2moe_keys

NAME = "qwen2moe"
HF_LAYER_NAMES = llama.HF_LAYER_NAMES | {
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = read_core(meta, NAME, source)
    moe = read_moe(meta, NAME, source, norm_w=False, gating="softmax")
    # the shared expert is feed_forward_length wide where the file leaves its own width out
    return replace(hp, rope_neox=True, moe=replace(moe, n_ff_shexp=moe.n_ff_shexp or hp.n_ff))


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    attn = [t for t in qwen2.layer_tensors(hp, il) if not t.field.startswith("ffn_")]  # attention and its biases
    gate = TensorSpec(
        "ffn_gate_inp_shexp", f"blk.{il}.ffn_gate_inp_shexp.weight", (1, hp.n_embd), "matrix", "replicated"
    )
    return attn + moe_tensors(hp, il) + shexp_tensors(hp, il) + [gate]


ARCH = Arch(
    name=NAME,
    hf_model_types=("qwen2_moe",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=qwen3moe.layer,  # pre-norm attention and experts; the shared expert is inside the MoE block
    hf=HFTable(HF_LAYER_NAMES, qwen2moe_keys, experts="mlp.experts"),
    chat_template="chatml",
)
