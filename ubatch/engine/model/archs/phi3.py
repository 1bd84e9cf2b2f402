"""Phi-3 and Phi-4 (dense): llama's layer over fused tensors (Q, K and V in one `attn_qkv`, gate
and up in one `ffn_up`, split into views of their rows, still as stored), RoPE on NEOX pairs over
`rope.dimension_count` dims (Phi-4-mini rotates 3/4 of each head). The 128k files (Phi-3-mini-128k,
Phi-3.5, Phi-4-mini) carry LongRoPE: two per-pair frequency divisors, `rope_factors_long` and
`rope_factors_short`, of which a context uses the long one when its per-sequence context exceeds
`rope.scaling.original_context_length` (llama.cpp's rule, fixed for the context; transformers
switches per forward by length), and `rope.scaling.attn_factor` on cos and sin. llama.cpp
disables Phi's sliding window; so does ubatch."""

from __future__ import annotations

import math
from dataclasses import replace

import gguf
import numpy as np

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.model.archs import llama
from ubatch.engine.model.archs.base import Arch, Config, HFTable, HParams, Meta, TensorSpec, read_core
from ubatch.engine.model.archs.hf_keys import cfg_int, cfg_num, rope_config, rope_theta

HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def read_hparams(meta: Meta, source: str) -> HParams:
    return replace(read_core(meta, "phi3", source), rope_neox=True)


def longrope(cfg: Config, src: str) -> tuple[list[float], list[float], float] | None:
    """LongRoPE's (long factors, short factors, attention factor) as the converter reads them
    from config.json (`su` is its old name), or None without them."""
    rs = rope_config(cfg) or {}
    kind = str(rs.get("rope_type", rs.get("type", ""))).lower()
    long, short = rs.get("long_factor"), rs.get("short_factor")
    if not long and kind not in ("longrope", "su"):
        return None
    if kind not in ("longrope", "su"):
        raise ModelLoadError(f"{src}: rope scaling {kind!r} with long_factor is not supported (only longrope)")
    n_embd, n_head = cfg_int(cfg, "hidden_size", src), cfg_int(cfg, "num_attention_heads", src)
    rot = cfg_num({"r": cfg.get("partial_rotary_factor", rs.get("partial_rotary_factor", 1.0))}, "r", src)
    half = int(rot * n_embd) // n_head // 2
    factors: list[list[float]] = []
    for key, v in (("long_factor", long), ("short_factor", short)):
        if not isinstance(v, list) or len(v) != half or not all(isinstance(x, (int, float)) and x > 0 for x in v):
            raise ModelLoadError(f"{src}: rope_scaling.{key}: expected {half} positive numbers (one per rotated pair)")
        factors.append([float(x) for x in v])
    n_ctx = cfg_int(cfg, "max_position_embeddings", src)
    orig = cfg_int(rs if "original_max_position_embeddings" in rs else cfg, "original_max_position_embeddings", src)
    scale = n_ctx / orig
    attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    return factors[0], factors[1], attn


def longrope_tensors(cfg: Config, src: str) -> dict[str, np.ndarray]:
    """The two factor tensors the converter writes for a LongRoPE checkpoint."""
    lr = longrope(cfg, src)
    if lr is None:
        return {}
    return {
        "rope_factors_long.weight": np.array(lr[0], dtype=np.float32),
        "rope_factors_short.weight": np.array(lr[1], dtype=np.float32),
    }


def layer_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    d, dk, dv, p = hp.n_embd, hp.n_embd_head_k, hp.n_embd_head_v, f"blk.{il}."
    q, k, v = hp.n_head * dk, hp.n_head_kv * dk, hp.n_head_kv * dv
    return [
        TensorSpec("attn_norm", p + "attn_norm.weight", (d,), "vector", "replicated"),
        TensorSpec("wqkv", p + "attn_qkv.weight", (q + k + v, d), "fused", "replicated",
                   parts=(("wq", q, "q_rows"), ("wk", k, "k_rows"), ("wv", v, "v_rows"))),
        TensorSpec("wo", p + "attn_output.weight", (d, hp.n_head * dv), "matrix", "q_cols"),
        TensorSpec("ffn_norm", p + "ffn_norm.weight", (d,), "vector", "replicated"),
        TensorSpec("ffn_gate_up", p + "ffn_up.weight", (2 * hp.n_ff, d), "fused", "replicated",
                   parts=(("ffn_gate", hp.n_ff, "ff_rows"), ("ffn_up", hp.n_ff, "ff_rows"))),
        TensorSpec("ffn_down", p + "ffn_down.weight", (d, hp.n_ff), "matrix", "ff_cols"),
    ]  # fmt: skip


def hf_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The keys the converter's Phi3MiniModel writes."""
    n_embd, n_head = cfg_int(cfg, "hidden_size", src), cfg_int(cfg, "num_attention_heads", src)
    rs = rope_config(cfg) or {}
    w.add_context_length(cfg_int(cfg, "max_position_embeddings", src))
    orig_from = rs if "original_max_position_embeddings" in rs else cfg
    w.add_rope_scaling_orig_ctx_len(cfg_int(orig_from, "original_max_position_embeddings", src, 4096))
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(cfg_int(cfg, "intermediate_size", src))
    w.add_block_count(cfg_int(cfg, "num_hidden_layers", src))
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg_int(cfg, "num_key_value_heads", src, n_head))
    w.add_layer_norm_rms_eps(cfg_num(cfg, "rms_norm_eps", src))
    rot = cfg.get("partial_rotary_factor", rs.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(
        int(cfg_num({"partial_rotary_factor": rot}, "partial_rotary_factor", src) * n_embd) // n_head
    )
    w.add_rope_freq_base(rope_theta(cfg, src) or 10000.0)
    sw = cfg.get("sliding_window")
    w.add_sliding_window(cfg_int(cfg, "sliding_window", src) if sw is not None else 0)
    lr = longrope(cfg, src)
    if lr is not None:
        w.add_rope_scaling_attn_factors(lr[2])


ARCH = Arch(
    name="phi3",
    hf_model_types=("phi3",),
    read_hparams=read_hparams,
    layer_tensors=layer_tensors,
    layer=llama.layer,  # the fused tensors are split into the blocks' fields at load
    hf=HFTable(HF_LAYER_NAMES, hf_keys, extra_tensors=longrope_tensors),
    chat_template="phi3",
)
