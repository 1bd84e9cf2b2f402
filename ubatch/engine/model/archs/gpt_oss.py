"""GPT-OSS (gpt-oss-20b, -120b): a mixture of experts with biases everywhere (Q, K, V, the
attention output, the router, every expert's gate, up and down), attention sinks (a per-head logit
in each softmax's denominator), sliding-window layers alternating with full ones, YaRN RoPE on NEOX
pairs, the router's softmax over the chosen experts' logits only, and SwiGLU with a clamp
(`swiglu_oai`: gate capped at 7, up clamped to ±7, gate·sigmoid(1.702·gate)·(up + 1))."""

from __future__ import annotations

from dataclasses import replace

from ubatch.engine.gguf.metadata import meta_float, meta_int
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
    read_core,
    read_moe,
    swa_pattern,
)
from ubatch.engine.model.archs.hf_keys import text_model_keys

NAME = "gpt-oss"


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = read_core(meta, NAME, source)
    n_swa = meta_int(meta, f"{NAME}.attention.sliding_window", source, 0, lo=0)
    return replace(
        hp,
        rope_neox=True,
        n_swa=n_swa,
        swa_layers=swa_pattern(meta, NAME, hp.n_layer, n_swa, source, 2),  # even layers slide
        rope_freq_base_swa=meta_float(meta, f"{NAME}.rope.freq_base_swa", source, hp.rope_freq_base, positive=True),
        rope_freq_scale_swa=hp.rope_freq_scale,
        ffn_act="swiglu_oai",
        moe=read_moe(meta, NAME, source, norm_w=False, gating="softmax_weight"),
    )


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    d, dk, dv, p = hp.n_embd, hp.n_embd_head_k, hp.n_embd_head_v, f"blk.{il}."
    own = [
        TensorSpec("bq", p + "attn_q.bias", (hp.n_head * dk,), "bias", "q_rows"),
        TensorSpec("bk", p + "attn_k.bias", (hp.n_head_kv * dk,), "bias", "k_rows"),
        TensorSpec("bv", p + "attn_v.bias", (hp.n_head_kv * dv,), "bias", "v_rows"),
        TensorSpec("bo", p + "attn_output.bias", (d,), "bias", "summed"),
        TensorSpec("attn_sinks", p + "attn_sinks.weight", (hp.n_head,), "vector", "heads"),
        TensorSpec("post_attn_norm", p + "post_attention_norm.weight", (d,), "vector", "replicated"),
    ]
    return attn_tensors(hp, il) + own + moe_tensors(hp, il, norm=False, biases=True)


def layer(b: Blocks[T], il: int, x: T) -> T:
    """Pre-norm attention, then the mixture of experts after the post-attention norm (its pre-norm),
    each added to the residual stream."""
    a = b.attention(b.norm(x, il, "attn_norm", f"attn_norm-{il}"), il)
    x = b.residual(x, a, il)
    f = b.moe(b.norm(x, il, "post_attn_norm", f"attn_post_norm-{il}"), il)
    return b.add(x, f, f"l_out-{il}")


HF_REFUSED = (
    "-m DIR does not read GPT-OSS checkpoints (MXFP4 experts, gate and up interleaved in one tensor); "
    "convert it with llama.cpp's convert_hf_to_gguf.py and pass the .gguf"
)
ARCH = Arch(
    name=NAME,
    hf_model_types=("gpt_oss",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=layer,
    hf=HFTable({}, text_model_keys, refused=HF_REFUSED),
    chat_template="chatml",
)
