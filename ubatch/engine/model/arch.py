"""The tensors a supported architecture's forward pass reads: GGUF name, shape, and whether required.

One table, read by the loader (engine/model/model.py checks a file against it and builds each
layer's weights from it) and by the Hugging Face checkpoint reader (engine/model/hf/checkpoint.py
maps and checks the safetensors shards against it), so the two cannot disagree on a name or a shape.
"""

from __future__ import annotations

from typing import NamedTuple

from ubatch.engine.model.hparams import HParams


class TensorSpec(NamedTuple):
    name: str  # the GGUF tensor name
    shape: tuple[int, ...]  # torch order, as the hparams imply it
    required: bool


def layer_tensors(hp: HParams, il: int) -> dict[str, TensorSpec]:
    """Layer il's tensors, by the LayerWeights field each one fills."""
    d, dk, dv = hp.n_embd, hp.n_embd_head_k, hp.n_embd_head_v
    p = f"blk.{il}."
    return {
        "attn_norm": TensorSpec(p + "attn_norm.weight", (d,), True),
        "wq": TensorSpec(p + "attn_q.weight", (hp.n_head * dk, d), True),
        "wk": TensorSpec(p + "attn_k.weight", (hp.n_head_kv * dk, d), True),
        "wv": TensorSpec(p + "attn_v.weight", (hp.n_head_kv * dv, d), True),
        "wo": TensorSpec(p + "attn_output.weight", (d, hp.n_head * dv), True),
        "ffn_norm": TensorSpec(p + "ffn_norm.weight", (d,), True),
        "ffn_gate": TensorSpec(p + "ffn_gate.weight", (hp.n_ff, d), True),
        "ffn_up": TensorSpec(p + "ffn_up.weight", (hp.n_ff, d), True),
        "ffn_down": TensorSpec(p + "ffn_down.weight", (d, hp.n_ff), True),
        "q_norm": TensorSpec(p + "attn_q_norm.weight", (dk,), hp.qk_norm),
        "k_norm": TensorSpec(p + "attn_k_norm.weight", (dk,), hp.qk_norm),
        "post_attn_norm": TensorSpec(p + "post_attention_norm.weight", (d,), hp.sandwich_norm),
        "post_ffn_norm": TensorSpec(p + "post_ffw_norm.weight", (d,), hp.sandwich_norm),
    }


def model_tensors(hp: HParams) -> dict[str, TensorSpec]:
    """The tensors outside the layers, by the Model field each one fills."""
    d, v = hp.n_embd, hp.n_vocab
    return {
        "tok_embd": TensorSpec("token_embd.weight", (v, d), True),
        "output": TensorSpec("output.weight", (v, d), False),  # absent: tied to token_embd
        "output_norm": TensorSpec("output_norm.weight", (d,), True),
        "rope_freqs": TensorSpec("rope_freqs.weight", (hp.n_rot // 2,), False),
    }


def expected_tensors(hp: HParams) -> dict[str, TensorSpec]:
    """Every tensor the forward pass reads, by GGUF name."""
    specs = list(model_tensors(hp).values())
    specs += [t for il in range(hp.n_layer) for t in layer_tensors(hp, il).values()]
    return {t.name: t for t in specs}
