"""Reading a Hugging Face config.json's values into GGUF keys, as llama.cpp's converter does:
each value checked where it is read, each refusal one line naming the key."""

from __future__ import annotations

import gguf

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.model.archs.base import Config


def cfg_int(cfg: Config, key: str, src: str, default: object = None) -> int:
    v = cfg.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelLoadError(f"{src}: {key} = {v!r}: expected a positive integer")
    return v


def cfg_num(cfg: Config, key: str, src: str, default: object = None) -> float:
    v = cfg.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ModelLoadError(f"{src}: {key} = {v!r}: expected a positive number")
    return float(v)


def rope_scaling(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
    rs = cfg.get("rope_scaling")
    if not isinstance(rs, dict):  # absent, null or not an object: no scaling
        return
    kind = rs.get("rope_type", rs.get("type"))
    if kind is None or kind == "default":
        return
    if kind != "linear" or not isinstance(rs.get("factor"), (int, float)):
        raise ModelLoadError(f"{src}: rope_scaling {rs!r} is not supported (only linear scaling)")
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(float(rs["factor"]))


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
    """rope_theta, where transformers writes it (at the top, or in `rope_parameters` since 5.0)."""
    params = cfg.get("rope_parameters")
    if "rope_theta" not in cfg and isinstance(params, dict) and "rope_theta" in params:
        return cfg_num(params, "rope_theta", src)
    return cfg_num(cfg, "rope_theta", src) if "rope_theta" in cfg else None


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
