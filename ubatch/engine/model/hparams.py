"""Typed model hyperparameters read from GGUF metadata (llama and gemma3).

Follows llama.cpp's loader: defaults for absent keys, gemma3's sliding-window layer pattern and
its separate RoPE base for local layers (reference/gguf-models.md §1.2, §3).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.metadata import (
    MISSING,
    bad_value,
    check_int,
    meta_bool,
    meta_float,
    meta_int,
    meta_per_layer,
    meta_str,
    show,
)
from ubatch.engine.gguf.string_array import StringArray

SUPPORTED_ARCHS = ("llama", "gemma3")
LLAMA_MAX_LAYERS = 512  # llama.cpp's bound on block_count
MAX_DIM = 1 << 20  # widths, heads and lengths past this are a corrupt file, not a model
MAX_VOCAB = 1 << 24
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")  # llama_pooling_type 0..4, as GGUF stores it


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
    causal_attn: bool  # `{arch}.attention.causal` (true when absent): false lets a query see later tokens
    pooling_type: str  # `{arch}.pooling_type` as a POOLING_TYPES name; llama.cpp's default is none

    def is_swa(self, il: int) -> bool:
        return self.swa_layers[il]

    def rope_params(self, il: int) -> tuple[float, float]:
        """(freq_base, freq_scale) of layer il: local layers have their own base."""
        if self.swa_layers[il]:
            return self.rope_freq_base_swa, self.rope_freq_scale_swa
        return self.rope_freq_base, self.rope_freq_scale


def _swa_pattern(meta: Mapping[str, object], arch: str, n_layer: int, n_swa: int, source: str) -> tuple[bool, ...]:
    if n_swa <= 0:
        return (False,) * n_layer
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = meta.get(key, 6)
    if isinstance(pattern, (list, np.ndarray)):
        if len(pattern) != n_layer or not all(isinstance(x, (bool, np.bool_)) or x in (0, 1) for x in pattern):
            raise bad_value(source, key, pattern, f"a period or an array of block_count = {n_layer} booleans")
        return tuple(bool(x) for x in pattern)
    period = check_int(source, key, pattern, 0, 1 << 20)
    if period == 0:
        return (True,) * n_layer
    return tuple((il % period) < period - 1 for il in range(n_layer))


def hparams_from_metadata(meta: Mapping[str, object], source: str = "model") -> HParams:
    """Every value checked for type and range before anything is sized from it."""
    arch = meta.get("general.architecture", "")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{source}: general.architecture {show(arch)} is not supported; ubatch runs {', '.join(SUPPORTED_ARCHS)}"
        )
    a = f"{arch}."
    n_layer = meta_int(meta, a + "block_count", source, hi=LLAMA_MAX_LAYERS)
    n_embd = meta_int(meta, a + "embedding_length", source, hi=MAX_DIM)
    n_head = meta_per_layer(meta, a + "attention.head_count", source, n_layer, hi=MAX_DIM)
    n_head_kv = meta_per_layer(meta, a + "attention.head_count_kv", source, n_layer, n_head, hi=n_head)
    if n_head % n_head_kv:
        raise bad_value(source, a + "attention.head_count_kv", n_head_kv, f"a divisor of head_count = {n_head}")
    n_ff = meta_per_layer(meta, a + "feed_forward_length", source, n_layer, hi=MAX_DIM)
    head_k = meta_int(meta, a + "attention.key_length", source, n_embd // n_head, hi=MAX_DIM)
    head_v = meta_int(meta, a + "attention.value_length", source, n_embd // n_head, hi=MAX_DIM)
    n_rot = meta_int(meta, a + "rope.dimension_count", source, head_k, hi=head_k)
    if n_rot % 2:
        raise bad_value(source, a + "rope.dimension_count", n_rot, "an even number (RoPE rotates pairs)")
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, (list, np.ndarray, StringArray)) else 0
    n_vocab = meta_int(meta, a + "vocab_size", source, n_tokens or MISSING, hi=MAX_VOCAB)
    linear = meta_float(meta, a + "rope.scale_linear", source, 0.0)
    scale_factor = meta_float(meta, a + "rope.scaling.factor", source, linear)
    scaling_type = meta_str(meta, a + "rope.scaling.type", source, "linear")
    if scaling_type not in ("none", "linear"):
        raise ModelLoadError(f"{source}: rope scaling {scaling_type!r} is not supported (only linear)")
    freq_scale = 1.0 / scale_factor if scale_factor and scaling_type == "linear" else 1.0
    if arch == "llama":
        if n_rot != head_k:
            raise ModelLoadError(f"{source}: llama requires rope.dimension_count == head size")
        n_swa = 0
        attn_scale, embd_scale = 1.0 / math.sqrt(head_k), 1.0
    else:
        n_swa = meta_int(meta, a + "attention.sliding_window", source, 0, lo=0)
        # the 27B model (62 layers) scales by n_embd / n_head instead of the head size
        attn_scale = 1.0 / math.sqrt(n_embd / n_head if n_layer == 62 else head_k)
        embd_scale = math.sqrt(n_embd)
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=meta_int(meta, a + "context_length", source),
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_rot=n_rot,
        rms_eps=meta_float(meta, a + "attention.layer_norm_rms_epsilon", source, positive=True),
        rope_neox=arch == "gemma3",
        rope_freq_base=meta_float(meta, a + "rope.freq_base", source, 10000.0, positive=True),
        rope_freq_scale=freq_scale,
        rope_freq_base_swa=meta_float(meta, a + "rope.freq_base_swa", source, 10000.0, positive=True),
        rope_freq_scale_swa=1.0,
        n_swa=n_swa,
        swa_layers=_swa_pattern(meta, arch, n_layer, n_swa, source),
        attn_scale=attn_scale,
        embd_scale=embd_scale,
        final_logit_softcap=meta_float(meta, a + "final_logit_softcapping", source, 0.0),
        sandwich_norm=arch == "gemma3",
        qk_norm=arch == "gemma3",
        ffn_act="gelu_tanh" if arch == "gemma3" else "silu",
        causal_attn=meta_bool(meta, a + "attention.causal", source, True),
        pooling_type=POOLING_TYPES[meta_int(meta, a + "pooling_type", source, 0, lo=0, hi=len(POOLING_TYPES) - 1)],
    )
