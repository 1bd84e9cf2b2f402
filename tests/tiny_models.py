"""Tiny llama / gemma3 GGUF files with random weights, written with gguf.GGUFWriter.

They exercise the loader, every quant type's matmul path and the forward pass in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from tiny_vocab import add_spm_vocab, tiny_spm_vocab

K_TYPES = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
# types gguf-py cannot quantise whose f16 scale is a block's first two bytes: random blocks with it small
RANDOM_IQ_TYPES = {T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S}


@dataclass
class TinySpec:
    arch: str = "gemma3"
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ff: int = 128
    n_ctx_train: int = 2048
    n_swa: int = 8  # gemma3 only
    swa_pattern: int = 2  # every 2nd layer global
    matrix_types: tuple[int, ...] = (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1, T.F16, T.F32)
    embd_type: int = T.Q8_0
    seed: int = 0
    extra: Callable[[gguf.GGUFWriter, np.random.Generator], None] | None = None  # more keys / tensors
    vocab: tuple[list[str], list[float], list[int]] | None = None  # another model's tokens (a draft)


def _random_k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: int) -> np.ndarray:
    """K-quant blocks of random bytes with small finite f16 scales (gguf-py cannot quantise K)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = rng.uniform(0.00005, 0.0002, size=(rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        raw[..., 208:210] = d[..., 0:2]
    elif qtype == T.Q3_K:
        raw[..., 108:110] = d[..., 0:2]
    elif qtype == T.Q2_K:
        raw[..., 80:84] = d
    else:  # Q4_K, Q5_K: d, dmin at the front
        raw[..., 0:4] = d
    return raw.reshape(rows, -1)


def _random_iq_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: int) -> np.ndarray:
    """Blocks of random bytes with a small f16 scale first (IQ4_NL's values reach 127 d)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(0.00005, 0.0002, size=(rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _tensor(w: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: int, rng: np.random.Generator) -> None:
    if qtype in K_TYPES:
        w.add_tensor(name, _random_k_blocks(rng, arr.shape[0], arr.shape[1], qtype), raw_dtype=qtype)
    elif qtype in RANDOM_IQ_TYPES:
        w.add_tensor(name, _random_iq_blocks(rng, arr.shape[0], arr.shape[1], qtype), raw_dtype=qtype)
    elif qtype in (T.F32, T.F16):
        w.add_tensor(name, arr.astype(np.float32 if qtype == T.F32 else np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)


def write_tiny_model(path: Path, spec: TinySpec | None = None) -> Path:
    s = spec or TinySpec()
    rng = np.random.default_rng(s.seed)
    tokens, scores, types = s.vocab or tiny_spm_vocab()
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    if s.arch == "gemma3":
        w.add_rope_freq_base(1_000_000.0)
        w.add_sliding_window(s.n_swa)
        w.add_sliding_window_pattern(s.swa_pattern)
    else:
        w.add_rope_freq_base(10_000.0)
    add_spm_vocab(w, tokens, scores, types)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(s.arch == "llama")

    def norm(n: int) -> np.ndarray:  # gemma norms are stored with the +1 folded in
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    types_cycle = list(s.matrix_types)
    k = 0

    def next_type(cols: int) -> int:
        nonlocal k
        for _ in range(len(types_cycle)):
            t = types_cycle[k % len(types_cycle)]
            k += 1
            if cols % gguf.GGML_QUANT_SIZES[t][0] == 0:
                return t
        return T.F32

    _tensor(w, "token_embd.weight", mat(n_vocab, s.n_embd) * 4, s.embd_type, rng)
    w.add_tensor("output_norm.weight", norm(s.n_embd))
    qd, kvd = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    for il in range(s.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(s.n_embd))
        for name, (r, c) in {
            "attn_q": (qd, s.n_embd),
            "attn_k": (kvd, s.n_embd),
            "attn_v": (kvd, s.n_embd),
            "attn_output": (s.n_embd, qd),
            "ffn_gate": (s.n_ff, s.n_embd),
            "ffn_up": (s.n_ff, s.n_embd),
            "ffn_down": (s.n_embd, s.n_ff),
        }.items():
            _tensor(w, p + name + ".weight", mat(r, c), next_type(c), rng)
        w.add_tensor(p + "ffn_norm.weight", norm(s.n_embd))
        if s.arch == "gemma3":
            w.add_tensor(p + "attn_q_norm.weight", norm(s.head_dim))
            w.add_tensor(p + "attn_k_norm.weight", norm(s.head_dim))
            w.add_tensor(p + "post_attention_norm.weight", norm(s.n_embd))
            w.add_tensor(p + "post_ffw_norm.weight", norm(s.n_embd))
    if s.extra is not None:
        s.extra(w, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
