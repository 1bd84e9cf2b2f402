"""DeepSeek-V2 / V2-Lite / V3 (and files of the same layout): multi-head latent attention with
the compressed KV cache (archs/base.py `MlaParams`: one row of kv_lora_rank + n_rot values per
token and layer, K only), q straight from x (V2-Lite) or through its low-rank pair, YaRN whose
magnitude goes into the attention scale, the first `leading_dense_block_count` layers dense, then
a mixture of experts with shared experts beside the routed ones. V2 routes by softmax; V3's
files (the converter writes them as deepseek2) say sigmoid (`expert_gating_func`), carry the
selection bias `exp_probs_b` and the expert groups (`read_moe`), and renormalise and scale.

llama.cpp's converter splits the checkpoint's kv_b into per-head attn_k_b (kv_lora_rank x
no-RoPE dims) and attn_v_b (value dims x kv_lora_rank), stored 3-D like experts, and writes
key_length / value_length as the cache's widths and key_length_mla / value_length_mla as the
heads'. Files from before that split (one attn_kv_b) are refused."""

from __future__ import annotations

import math
from dataclasses import replace

import gguf
import numpy as np

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.metadata import bad_value, meta_float, meta_int
from ubatch.engine.model.archs.base import (
    MAX_DIM,
    Arch,
    Blocks,
    Config,
    HFRewrite,
    HFTable,
    HParams,
    Meta,
    MlaParams,
    T,
    TensorSpec,
    ffn_tensors,
    moe_tensors,
    read_core,
    read_moe,
    shexp_tensors,
)
from ubatch.engine.model.archs.hf_keys import cfg_count, cfg_int, cfg_num, moe_keys, rope_config, text_model_keys

NAME = "deepseek2"


def _yarn_scales(meta: Meta, hp: HParams, source: str) -> tuple[float, float]:
    """(magnitude of cos/sin, mscale of q·k) as llama.cpp's deepseek2 graph and context set them:
    with `yarn_log_multiplier` (the converter writes 0.1·mscale_all_dim) the rotation keeps unit
    magnitude and the scale carries (1 + 0.1·mscale_all_dim·ln s)², as transformers' softmax
    scale does; the file's `rope.scaling.attn_factor` multiplies both."""
    a = f"{NAME}."
    attn_factor = meta_float(meta, a + "rope.scaling.attn_factor", source, 1.0, positive=True)
    if not hp.rope_yarn_factors:  # no yarn: nothing but the file's factor
        return attn_factor, attn_factor
    ln_s = math.log(meta_float(meta, a + "rope.scaling.factor", source, positive=True))
    log_mul = meta_float(meta, a + "rope.scaling.yarn_log_multiplier", source, 0.0) / 0.1
    mag = attn_factor * (1.0 if log_mul else 1.0 + 0.1 * ln_s)
    return mag, mag * (1.0 + 0.1 * log_mul * ln_s)


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = read_core(meta, NAME, source)
    a = f"{NAME}."
    if a + "attention.key_length_mla" not in meta:
        raise ModelLoadError(
            f"{source}: a deepseek2 file without {a}attention.key_length_mla (an attn_kv_b conversion from before "
            "llama.cpp split it into attn_k_b / attn_v_b); convert the checkpoint again with a current convert_hf_to_gguf.py"
        )
    kv_lora = meta_int(meta, a + "attention.kv_lora_rank", source, hi=MAX_DIM)
    mla = MlaParams(
        q_lora_rank=meta_int(meta, a + "attention.q_lora_rank", source, 0, lo=0, hi=MAX_DIM),
        kv_lora_rank=kv_lora,
        n_embd_head_k=meta_int(meta, a + "attention.key_length_mla", source, hi=MAX_DIM),
        n_embd_head_v=meta_int(meta, a + "attention.value_length_mla", source, hi=MAX_DIM),
    )
    if hp.n_head_kv != 1:
        raise bad_value(source, a + "attention.head_count_kv", hp.n_head_kv, "1 (the compressed row every head shares)")
    if hp.n_embd_head_k != kv_lora + hp.n_rot or hp.n_embd_head_v != kv_lora:
        raise bad_value(
            source,
            a + "attention.key_length",
            (hp.n_embd_head_k, hp.n_embd_head_v),
            f"key_length = kv_lora_rank + rope dims = {kv_lora + hp.n_rot} and value_length = kv_lora_rank = {kv_lora}",
        )
    if not hp.n_rot < mla.n_embd_head_k:
        raise bad_value(source, a + "rope.dimension_count", hp.n_rot, f"below key_length_mla = {mla.n_embd_head_k}")
    n_ff_exp = meta_int(meta, a + "expert_feed_forward_length", source, hi=MAX_DIM)
    n_shared = meta_int(meta, a + "expert_shared_count", source, 0, lo=0, hi=1 << 10)
    moe = replace(
        read_moe(meta, NAME, source),
        n_ff_shexp=n_ff_exp * n_shared,
        n_dense_lead=meta_int(meta, a + "leading_dense_block_count", source, 0, lo=0, hi=hp.n_layer),
    )
    mag, mscale = _yarn_scales(meta, hp, source)
    return replace(hp, mla=mla, moe=moe, rope_mscale=mag, attn_scale=mscale * mscale / math.sqrt(mla.n_embd_head_k))


HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",  # split per head (split_kv_b)
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate.e_score_correction": "exp_probs_b",  # the converter's name for e_score_correction_bias
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
KV_B = ("attn_k_b", "attn_v_b")


def split_kv_b(kv_b: np.ndarray, hp: HParams) -> dict[str, np.ndarray]:
    """The converter's split of kv_b (heads x (no-RoPE + value dims), kv_lora_rank): each head's
    k_b transposed to (kv_lora_rank, no-RoPE dims), its v_b as it is."""
    assert hp.mla is not None
    nope = hp.mla.n_embd_head_k - hp.n_rot
    kv = kv_b.reshape(hp.n_head, nope + hp.mla.n_embd_head_v, kv_b.shape[-1])
    return {"attn_k_b": kv[:, :nope].transpose(0, 2, 1).copy(), "attn_v_b": kv[:, nope:].copy()}


def hf_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The converter's DeepseekV2Model (V2, V2-Lite, V3): MLA written as one KV head of the
    compressed row's width, the heads' own widths as the _mla keys, the experts' keys."""
    text_model_keys(
        w, {**cfg, "num_key_value_heads": 1, "head_dim": None, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6)}, src
    )
    moe_keys(w, cfg, src)
    n_layer = cfg_int(cfg, "num_hidden_layers", src)
    moe = cfg.get("n_routed_experts") is not None  # else every layer dense (Youtu)
    w.add_leading_dense_block_count(cfg_count(cfg, "first_k_dense_replace", src, 0 if moe else n_layer))
    w.add_vocab_size(cfg_int(cfg, "vocab_size", src))
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg_int(cfg, "q_lora_rank", src))
    kv_lora, rope = cfg_int(cfg, "kv_lora_rank", src, 512), cfg_int(cfg, "qk_rope_head_dim", src)
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(cfg_int(cfg, "qk_nope_head_dim", src) + rope)
    w.add_value_length_mla(cfg_int(cfg, "v_head_dim", src))
    ff = "moe_intermediate_size" if "moe_intermediate_size" in cfg else "intermediate_size"
    w.add_expert_feed_forward_length(cfg_int(cfg, ff, src))
    w.add_expert_shared_count(cfg_count(cfg, "n_shared_experts", src, 0))
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(cfg_num(cfg, "routed_scaling_factor", src))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    rs = rope_config(cfg)
    if rs is not None and rs.get("mscale_all_dim") is not None:  # the converter's 0.1 factor, undone in _yarn_scales
        w.add_rope_scaling_yarn_log_mul(0.1 * cfg_num(rs, "mscale_all_dim", src))


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    assert hp.mla is not None and hp.moe is not None
    m, d, p, h = hp.mla, hp.n_embd, f"blk.{il}.", hp.n_head
    nope, r = m.n_embd_head_k - hp.n_rot, m.kv_lora_rank
    # -tp as vLLM runs MLA: every rank computes the compressed row (and caches it whole) and q's
    # low-rank part; q, k_b, v_b are cut by heads, the output by those heads' columns (then summed)
    out = [TensorSpec("attn_norm", p + "attn_norm.weight", (d,), "vector", "replicated")]
    if m.q_lora_rank:
        out += [
            TensorSpec("wq_a", p + "attn_q_a.weight", (m.q_lora_rank, d), "matrix", "replicated"),
            TensorSpec("q_a_norm", p + "attn_q_a_norm.weight", (m.q_lora_rank,), "vector", "replicated"),
            TensorSpec("wq_b", p + "attn_q_b.weight", (h * m.n_embd_head_k, m.q_lora_rank), "matrix", "q_rows"),
        ]
    else:
        out.append(TensorSpec("wq", p + "attn_q.weight", (h * m.n_embd_head_k, d), "matrix", "q_rows"))
    out += [
        TensorSpec("wkv_a", p + "attn_kv_a_mqa.weight", (r + hp.n_rot, d), "matrix", "replicated"),
        TensorSpec("kv_a_norm", p + "attn_kv_a_norm.weight", (r,), "vector", "replicated"),
        TensorSpec("wk_b", p + "attn_k_b.weight", (h, r, nope), "experts", "head_exps"),
        TensorSpec("wv_b", p + "attn_v_b.weight", (h, m.n_embd_head_v, r), "experts", "head_exps"),
        TensorSpec("wo", p + "attn_output.weight", (d, h * m.n_embd_head_v), "matrix", "q_cols"),
    ]
    if il < hp.moe.n_dense_lead:
        return out + ffn_tensors(hp, il)
    probs_b = TensorSpec("exp_probs_b", p + "exp_probs_b.bias", (hp.moe.n_expert,), "bias", "replicated", False)
    shared = shexp_tensors(hp, il) if hp.moe.n_ff_shexp else []
    return out + moe_tensors(hp, il, gate_up=True) + shared + [probs_b]


def layer(b: Blocks[T], il: int, x: T) -> T:
    """Pre-norm latent attention, then the pre-normed dense FFN (leading layers) or mixture of
    experts with its shared experts, each added to the residual stream."""
    assert b.hp.moe is not None
    a = b.attention(b.norm(x, il, "attn_norm", f"attn_norm-{il}"), il)
    x = b.residual(x, a, il)
    h = b.norm(x, il, "ffn_norm", f"ffn_norm-{il}")
    f = b.ffn(h, il) if il < b.hp.moe.n_dense_lead else b.moe(h, il)
    return b.add(x, f, f"l_out-{il}")


ARCH = Arch(
    name=NAME,
    hf_model_types=("deepseek_v2", "deepseek_v3"),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=layer,
    hf=HFTable(HF_LAYER_NAMES, hf_keys, experts="mlp.experts", rewrites={"attn_kv_b": HFRewrite(KV_B, split_kv_b)}),
    chat_template="chatml",
)
