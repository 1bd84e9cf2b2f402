"""A Hugging Face `config.json` written as the GGUF keys llama.cpp's converter writes for it.

The keys go into a path-less `gguf.GGUFWriter` through the same `add_*` calls the converter
makes, so a checkpoint's metadata has the converter's names and value types, and `ubatch
convert` copies exactly those keys into the file it writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from ubatch.engine.errors import ModelLoadError

# HF model_type -> GGUF architecture
MODEL_TYPES = {"llama": "llama", "gemma3_text": "gemma3"}
Config = dict[str, object]  # config.json's object: every value is checked where it is read


def read_config(d: Path) -> tuple[str, Config]:
    """(GGUF arch, the text model's config) of checkpoint directory d, or one line saying why not."""
    f = d / "config.json"
    if not f.is_file():
        raise ModelLoadError(
            f"{d}: no config.json; a Hugging Face checkpoint directory needs one (or pass a .gguf file)"
        )
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{f}: expected a JSON object")
    mt = cfg.get("model_type")
    text = cfg.get("text_config")
    if mt == "gemma3" and isinstance(text, dict):  # Gemma3ForConditionalGeneration: its text model only
        cfg, mt = {**cfg, **text}, "gemma3_text"
    elif mt == "gemma3":
        raise ModelLoadError(f"{f}: model_type 'gemma3' without a text_config object; the config is incomplete")
    if mt not in MODEL_TYPES:
        raise ModelLoadError(
            f"{f}: model_type {mt!r} is not supported; ubatch runs Hugging Face checkpoints of {', '.join(MODEL_TYPES)}"
        )
    return MODEL_TYPES[mt], cfg


def _int(cfg: Config, key: str, src: str, default: object = None) -> int:
    v = cfg.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelLoadError(f"{src}: {key} = {v!r}: expected a positive integer")
    return v


def _num(cfg: Config, key: str, src: str, default: object = None) -> float:
    v = cfg.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ModelLoadError(f"{src}: {key} = {v!r}: expected a positive number")
    return float(v)


def _rope_scaling(w: gguf.GGUFWriter, cfg: Config, src: str) -> None:
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


def write_hparams(w: gguf.GGUFWriter, arch: str, cfg: Config, src: str) -> None:
    """The architecture keys, as the converter's LlamaModel / Gemma3Model set them."""
    n_layer = _int(cfg, "num_hidden_layers", src)
    n_embd = _int(cfg, "hidden_size", src)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(_int(cfg, "intermediate_size", src))
    _rope_scaling(w, cfg, src)
    if arch == "llama":
        n_head = _int(cfg, "num_attention_heads", src)
        if "max_position_embeddings" in cfg:
            w.add_context_length(_int(cfg, "max_position_embeddings", src))
        w.add_head_count(n_head)
        w.add_head_count_kv(_int(cfg, "num_key_value_heads", src, n_head))
        if "rope_theta" in cfg:
            w.add_rope_freq_base(_num(cfg, "rope_theta", src))
        w.add_layer_norm_rms_eps(_num(cfg, "rms_norm_eps", src))
        w.add_vocab_size(_int(cfg, "vocab_size", src))
        head_dim = _int({"head_dim": cfg.get("head_dim") or n_embd // n_head}, "head_dim", src)
        w.add_rope_dimension_count(head_dim)
        if head_dim != n_embd // n_head:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        return
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{src}: attn_logit_softcapping is set; gemma3 has none (a gemma2 config?)")
    head_dim = _int(cfg, "head_dim", src, 256)
    w.add_context_length(_int(cfg, "max_position_embeddings", src, 131072))
    w.add_head_count(_int(cfg, "num_attention_heads", src, 8))
    w.add_layer_norm_rms_eps(_num(cfg, "rms_norm_eps", src, 1e-6))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(_num(cfg, "rope_theta", src, 1_000_000.0))
    if "rope_local_base_freq" in cfg:
        w.add_rope_freq_base_swa(_num(cfg, "rope_local_base_freq", src))
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(_num(cfg, "final_logit_softcapping", src))
    if cfg.get("sliding_window_pattern") != 1:
        w.add_sliding_window(_int(cfg, "sliding_window", src))
    w.add_head_count_kv(_int(cfg, "num_key_value_heads", src, 4))
