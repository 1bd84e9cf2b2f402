"""Typed model hyperparameters read from GGUF metadata (llama and gemma3).

Follows llama.cpp's loader: defaults for absent keys, gemma3's sliding-window layer pattern and
its separate RoPE base for local layers (reference/gguf-models.md §1.2, §3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import ModelLoadError

SUPPORTED_ARCHS = ("llama", "gemma3")


@dataclass(slots=True, frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    rms_eps: float
    rope_neox: bool  # NEOX pairs (i, i + n_rot/2); NORM pairs (2i, 2i+1)
    rope_freq_base: float
    rope_freq_scale: float
    rope_freq_base_swa: float
    rope_freq_scale_swa: float
    n_swa: int  # 0 = no sliding window
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window
    attn_scale: float  # applied to q after RoPE
    embd_scale: float  # 1.0 = none (llama); sqrt(n_embd) for gemma
    final_logit_softcap: float  # 0 = off
    sandwich_norm: bool  # gemma: post-attention / post-ffn norms before the residual add
    qk_norm: bool
    ffn_act: str  # "silu" (llama) or "gelu_tanh" (gemma)

    def is_swa(self, il: int) -> bool:
        return self.swa_layers[il]

    def rope_params(self, il: int) -> tuple[float, float]:
        """(freq_base, freq_scale) of layer il: local layers have their own base."""
        if self.swa_layers[il]:
            return self.rope_freq_base_swa, self.rope_freq_scale_swa
        return self.rope_freq_base, self.rope_freq_scale


def _get(meta: dict[str, Any], key: str, source: str, default: Any = ...) -> Any:
    if key in meta:
        return meta[key]
    if default is ...:
        raise ModelLoadError(f"{source}: required metadata key {key!r} is missing; the GGUF is incomplete")
    return default


def _per_layer(value: Any, n_layer: int, key: str, source: str) -> int:
    """llama.cpp allows per-layer arrays for head counts / n_ff; we need them uniform."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{source}: per-layer {key} values differ; such models are not supported")
        return int(value[0])
    return int(value)


def _swa_pattern(meta: dict[str, Any], arch: str, n_layer: int, n_swa: int) -> tuple[bool, ...]:
    if n_swa <= 0:
        return (False,) * n_layer
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        return tuple(bool(x) for x in pattern[:n_layer])
    period = int(pattern)
    if period == 0:
        return (True,) * n_layer
    return tuple((il % period) < period - 1 for il in range(n_layer))


def hparams_from_metadata(meta: dict[str, Any], source: str = "model") -> HParams:
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r}; ubatch runs {', '.join(SUPPORTED_ARCHS)}")
    g = lambda key, default=...: _get(meta, f"{arch}.{key}", source, default)  # noqa: E731
    n_layer = int(g("block_count"))
    n_embd = int(g("embedding_length"))
    n_head = _per_layer(g("attention.head_count"), n_layer, "head_count", source)
    n_head_kv = _per_layer(g("attention.head_count_kv", n_head), n_layer, "head_count_kv", source)
    n_ff = _per_layer(g("feed_forward_length", 0), n_layer, "feed_forward_length", source)
    head_k = int(g("attention.key_length", n_embd // n_head))
    head_v = int(g("attention.value_length", n_embd // n_head))
    n_rot = int(g("rope.dimension_count", head_k))
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(g("vocab_size", len(tokens) if tokens is not None else 0))
    scale_factor = float(g("rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear", 0.0)))
    scaling_type = str(g("rope.scaling.type", "linear"))
    if scaling_type not in ("none", "linear"):
        raise ModelLoadError(f"{source}: rope scaling {scaling_type!r} is not supported (only linear)")
    freq_scale = 1.0 / scale_factor if scale_factor and scaling_type == "linear" else 1.0
    if arch == "llama":
        if n_rot != head_k:
            raise ModelLoadError(f"{source}: llama requires rope.dimension_count == head size")
        n_swa = 0
        attn_scale, embd_scale = 1.0 / math.sqrt(head_k), 1.0
    else:
        n_swa = int(g("attention.sliding_window", 0))
        # the 27B model (62 layers) scales by n_embd / n_head instead of the head size
        attn_scale = 1.0 / math.sqrt(n_embd / n_head if n_layer == 62 else head_k)
        embd_scale = math.sqrt(n_embd)
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=int(g("context_length")),
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_rot=n_rot,
        rms_eps=float(g("attention.layer_norm_rms_epsilon")),
        rope_neox=arch == "gemma3",
        rope_freq_base=float(g("rope.freq_base", 10000.0)),
        rope_freq_scale=freq_scale,
        rope_freq_base_swa=float(g("rope.freq_base_swa", 10000.0)),
        rope_freq_scale_swa=1.0,
        n_swa=n_swa,
        swa_layers=_swa_pattern(meta, arch, n_layer, n_swa),
        attn_scale=attn_scale,
        embd_scale=embd_scale,
        final_logit_softcap=float(g("final_logit_softcapping", 0.0) or 0.0),
        sandwich_norm=arch == "gemma3",
        qk_norm=arch == "gemma3",
        ffn_act="gelu_tanh" if arch == "gemma3" else "silu",
    )
