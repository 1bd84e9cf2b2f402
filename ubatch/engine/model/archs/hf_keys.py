"""Reading a Hugging Face config.json's values into GGUF keys, as llama.cpp's converter does:
each value checked where it is read, each refusal one line naming the key."""

from __future__ import annotations

import math

import gguf
import numpy as np

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.model.archs.base import Config


def cfg_int(cfg: Config, key: str, src: str, default: object = None) -> int:
    v = cfg.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelLoadError(f"{src}: {key} = {v!r}: expected a positive integer")
    return v


def cfg_count(cfg: Config, key: str, src: str, default: int) -> int:
    """A count that may be 0; `default` where config.json leaves it out or sets it to null."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ModelLoadError(f"{src}: {key} = {v!r}: expected an integer >= 0")
    return v


def cfg_num(cfg: Config, key: str, src: str, default: object = None) -> float:
    v = cfg.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ModelLoadError(f"{src}: {key} = {v!r}: expected a positive number")
    return float(v)


def rope_config(cfg: Config) -> dict[str, object] | None:
    """The rope scaling object: `rope_scaling`, or `rope_parameters` (transformers 5 writes its
    theta and scaling there); None without one."""
    for key in ("rope_scaling", "rope_parameters"):
        rs = cfg.get(key)
        if isinstance(rs, dict):
            return rs
    return None


def rope_scaling(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The scaling keys (linear); llama3's scaling is a tensor instead (`llama3_rope_freqs`)."""
    rs = rope_config(cfg)
    kind = rs.get("rope_type", rs.get("type")) if rs is not None else None
    if rs is None or kind is None or kind in ("default", "llama3"):
        return
    if kind not in ("linear", "yarn") or not isinstance(rs.get("factor"), (int, float)):
        raise ModelLoadError(f"{src}: rope_scaling {rs!r} is not supported (only linear, yarn and llama3 scaling)")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg_num(rs, "factor", src))
        return
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)  # as the converter's TextModel writes it
    w.add_rope_scaling_factor(cfg_num(rs, "factor", src))
    w.add_rope_scaling_orig_ctx_len(cfg_int(rs, "original_max_position_embeddings", src))
    for key, add in (
        ("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
        ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
        ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
        ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
    ):
        if rs.get(key) is not None:
            add(cfg_num(rs, key, src))


def llama3_rope_freqs(cfg: Config, src: str) -> dict[str, np.ndarray]:
    """`rope_freqs.weight` as the converter computes it from llama3 rope scaling: per rotated pair,
    the factor its frequency is divided by (1 for short wavelengths, `factor` for long ones, a
    smooth mix between)."""
    rs = rope_config(cfg)
    if rs is None or rs.get("rope_type", rs.get("type")) != "llama3":
        return {}
    base = float(rope_theta(cfg, src) or 10000.0)
    n_head = cfg_int(cfg, "num_attention_heads", src)
    dim = cfg_int({"head_dim": cfg.get("head_dim") or cfg_int(cfg, "hidden_size", src) // n_head}, "head_dim", src)
    factor = cfg_num(rs, "factor", src, 8.0)
    low, high = cfg_num(rs, "low_freq_factor", src, 1.0), cfg_num(rs, "high_freq_factor", src, 4.0)
    old_ctx = cfg_num(rs, "original_max_position_embeddings", src, 8192)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))  # f32, as the converter's torch
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": np.array(out, dtype=np.float32)}


def llama_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The keys the converter's LlamaModel (and the families built on it) writes."""
    n_layer = cfg_int(cfg, "num_hidden_layers", src)
    n_embd = cfg_int(cfg, "hidden_size", src)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(cfg_int(cfg, "intermediate_size", src))
    rope_scaling(w, cfg, src)
    n_head = cfg_int(cfg, "num_attention_heads", src)
    if "max_position_embeddings" in cfg:
        w.add_context_length(cfg_int(cfg, "max_position_embeddings", src))
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg_int(cfg, "num_key_value_heads", src, n_head))
    theta = rope_theta(cfg, src)
    if theta is not None:
        w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg_num(cfg, "rms_norm_eps", src))
    w.add_vocab_size(cfg_int(cfg, "vocab_size", src))
    head_dim = cfg_int({"head_dim": cfg.get("head_dim") or n_embd // n_head}, "head_dim", src)
    w.add_rope_dimension_count(head_dim)
    if head_dim != n_embd // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def rope_theta(cfg: Config, src: str) -> float | None:
    """rope_theta, where transformers writes it (at the top, or in `rope_parameters` since 5.0,
    per attention type for models with sliding-window layers: the global layers' here)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if "rope_theta" not in cfg and isinstance(params, dict) and "rope_theta" in params:
        return cfg_num(params, "rope_theta", src)
    return cfg_num(cfg, "rope_theta", src) if "rope_theta" in cfg else None


def rope_theta_swa(cfg: Config, src: str) -> float | None:
    """The sliding-window layers' rope_theta: `rope_parameters.sliding_attention` (transformers 5)
    or a top-level key (`rope_local_base_freq`, gemma3 under transformers 4), as the converter reads it."""
    params = cfg.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict) and "rope_theta" in local:
        return cfg_num(local, "rope_theta", src)
    for key in ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq"):
        if key in cfg:
            return cfg_num(cfg, key, src)
    return None


def text_model_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The keys the converter's TextModel writes for a plain decoder (Qwen2Model and its kin)."""
    w.add_block_count(cfg_int(cfg, "num_hidden_layers", src))
    if "max_position_embeddings" in cfg:
        w.add_context_length(cfg_int(cfg, "max_position_embeddings", src))
    w.add_embedding_length(cfg_int(cfg, "hidden_size", src))
    w.add_feed_forward_length(cfg_int(cfg, "intermediate_size", src))
    n_head = cfg_int(cfg, "num_attention_heads", src)
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg_int(cfg, "num_key_value_heads", src, n_head))
    rope_scaling(w, cfg, src)
    theta = rope_theta(cfg, src)
    if theta is not None:
        w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg_num(cfg, "rms_norm_eps", src))
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg_int(cfg, "head_dim", src))
        w.add_value_length(cfg_int(cfg, "head_dim", src))


def _first(cfg: Config, keys: tuple[str, ...]) -> tuple[str, object]:
    """The first of keys config.json has and its value, as the converter's find_hparam; ("", None) if none."""
    key = next((k for k in keys if k in cfg), "")
    return key, cfg.get(key)


def moe_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The expert keys the converter's TextModel writes from any config: the expert count and
    used count, the expert groups, the router's scoring function."""
    for keys, add in (
        (("num_local_experts", "num_experts", "n_routed_experts"), w.add_expert_count),
        (("num_experts_per_tok", "num_experts_per_token", "top_k_experts"), w.add_expert_used_count),
        (("n_group",), w.add_expert_group_count),
        (("topk_group",), w.add_expert_group_used_count),
    ):
        key, v = _first(cfg, keys)
        if v is not None:
            add(cfg_int(cfg, key, src))
    funcs = ("score_function", "scoring_func", "score_func", "moe_router_activation", "moe_router_activation_func")
    key, v = _first(cfg, (*funcs, "expert_selection_fn"))
    if v is not None:
        kinds = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
        if v not in kinds:
            raise ModelLoadError(f"{src}: {key} = {v!r}: only sigmoid and softmax expert scoring are supported")
        w.add_expert_gating_func(kinds[str(v)])


def qwen2moe_keys(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    """The converter's Qwen2MoeModel (and Qwen3MoeModel): a plain decoder's keys, the experts',
    and the routed and shared experts' widths."""
    text_model_keys(w, cfg, src)
    moe_keys(w, cfg, src)
    if cfg.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(cfg_int(cfg, "moe_intermediate_size", src))
    if cfg.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(cfg_int(cfg, "shared_expert_intermediate_size", src))
