"""Tiny Hugging Face checkpoints (config.json, safetensors shards, a trained tokenizer.model).

The SentencePiece model is trained here on generated text, so the tests need no network and
no downloaded tokenizer; weights are random, in the dtype asked for.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

WORDS = "the a cat dog runs sat on mat red blue green quick brown fox jumps over lazy river tree stone light".split()


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        if i % 7 == 0:
            words.append(f"{rng.randint(0, 9999)}")
        if i % 11 == 0:
            words.append(rng.choice(["naïve", "café", "über", "日本", "ok!", "(x)"]))
        lines.append(" ".join(words))
    return lines


def train_spm(vocab_size: int = 400) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",  # as Llama's tokenizer: llama.cpp does not normalise
        remove_extra_whitespaces=False,
        split_digits=True,
        minloglevel=2,
    )
    return buf.getvalue()


_SPM: dict[int, bytes] = {}


@dataclass
class HFSpec:
    arch: str = "llama"
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 96
    dtype: torch.dtype = torch.float16
    tied: bool = False
    shards: int = 1
    vocab_size: int = 400
    seed: int = 0
    multimodal: bool = False  # gemma3 as Gemma3ForConditionalGeneration: text_config, prefixed names


def config(s: HFSpec) -> dict:
    head_dim = s.n_embd // s.n_head
    c = {
        "hidden_size": s.n_embd,
        "num_hidden_layers": s.n_layer,
        "num_attention_heads": s.n_head,
        "num_key_value_heads": s.n_head_kv,
        "intermediate_size": s.n_ff,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": s.tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if s.arch == "llama":
        return c | {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0}
    return c | {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 8,
        "query_pre_attn_scalar": head_dim,
    }


def tensors(s: HFSpec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(s.seed)
    hd = s.n_embd // s.n_head

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * 0.2).to(s.dtype)

    def norm(n: int) -> torch.Tensor:
        base = 0.0 if s.arch == "gemma3" else 1.0  # gemma3 stores w and scales by 1 + w
        return (base + 0.1 * torch.randn(n, generator=g)).to(s.dtype)

    t = {"model.embed_tokens.weight": mat(s.vocab_size, s.n_embd), "model.norm.weight": norm(s.n_embd)}
    if not s.tied:
        t["lm_head.weight"] = mat(s.vocab_size, s.n_embd)
    for il in range(s.n_layer):
        p = f"model.layers.{il}."
        t |= {
            p + "input_layernorm.weight": norm(s.n_embd),
            p + "self_attn.q_proj.weight": mat(s.n_head * hd, s.n_embd),
            p + "self_attn.k_proj.weight": mat(s.n_head_kv * hd, s.n_embd),
            p + "self_attn.v_proj.weight": mat(s.n_head_kv * hd, s.n_embd),
            p + "self_attn.o_proj.weight": mat(s.n_embd, s.n_head * hd),
            p + "post_attention_layernorm.weight": norm(s.n_embd),
            p + "mlp.gate_proj.weight": mat(s.n_ff, s.n_embd),
            p + "mlp.up_proj.weight": mat(s.n_ff, s.n_embd),
            p + "mlp.down_proj.weight": mat(s.n_embd, s.n_ff),
        }
        if s.arch == "gemma3":
            t |= {
                p + "self_attn.q_norm.weight": norm(hd),
                p + "self_attn.k_norm.weight": norm(hd),
                p + "pre_feedforward_layernorm.weight": norm(s.n_embd),
                p + "post_feedforward_layernorm.weight": norm(s.n_embd),
            }
    return t


def write_tiny_hf(d: Path, spec: HFSpec | None = None) -> Path:
    """A checkpoint directory: config.json, tokenizer.model, tokenizer_config.json, safetensors."""
    s = spec or HFSpec()
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config(s)))
    if s.vocab_size not in _SPM:
        _SPM[s.vocab_size] = train_spm(s.vocab_size)
    (d / "tokenizer.model").write_bytes(_SPM[s.vocab_size])
    tc = {
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    ts = tensors(s)
    if s.multimodal:
        text = config(s)
        wrapped = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
        (d / "config.json").write_text(json.dumps(wrapped | {"vision_config": {"hidden_size": 8}}))
        ts = {k.replace("model.", "model.language_model.", 1): v for k, v in ts.items()}
        ts["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8, dtype=s.dtype)
        ts["model.multi_modal_projector.mm_input_projection_weight"] = torch.ones(8, 8, dtype=s.dtype)
    if s.shards == 1:
        save_file(ts, str(d / "model.safetensors"))
        return d
    names = sorted(ts)
    weight_map = {}
    for i in range(s.shards):
        fname = f"model-{i + 1:05d}-of-{s.shards:05d}.safetensors"
        part = {n: ts[n] for n in names[i :: s.shards]}
        save_file(part, str(d / fname))
        weight_map |= dict.fromkeys(part, fname)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d
