"""Tiny random Hugging Face checkpoints of each family, made with transformers' own config and
model classes, and their GGUF conversions by llama.cpp's own convert_hf_to_gguf.py.

Weights are drawn with a seed at a scale that gives the logits a clear top-1 (transformers' init
of std 0.02 makes every token nearly equally likely), saved as safetensors with the tiny
SentencePiece model of tiny_hf.py (the converter reads a tokenizer.model first for these
families; the forward tests feed token ids). Checkpoints and conversions are cached per session
under pytest's temporary folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from tiny_hf import train_spm

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_TOOL = ROOT.parent / "shared" / "tools" / "llama-cpp.sh"
VOCAB = 400  # the tiny SentencePiece model's size


@dataclass(frozen=True)
class Family:
    config: str  # transformers' config class
    model: str  # transformers' causal-LM class
    gguf_arch: str
    extra: dict[str, object] = field(default_factory=dict)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
FAMILIES = {
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {"head_dim": 64}),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", "qwen2"),
    # Llama 3.2 as it is written: llama3 rope scaling (rope_freqs), a tied output
    "llama3": Family(
        "LlamaConfig",
        "LlamaForCausalLM",
        "llama",
        {
            "rope_scaling": LLAMA3_ROPE | {"original_max_position_embeddings": 64},
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
        },
    ),
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "gemma2",
        {
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 64,  # inside the 300 positions the tests read
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh",
            "attn_implementation": "eager",  # soft-capping: transformers' eager attention
            "tie_word_embeddings": True,  # the converter drops lm_head: gemma2 is tied
        },
    ),
    # Gemma 3 as transformers 5 writes it, rope_theta per attention type in rope_parameters; six
    # layers, the sixth global, as llama.cpp lays gemma3 out whatever layer_types says
    "gemma3": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "gemma3",
        {
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 64,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_theta": 200000.0, "rope_type": "default"},
                "sliding_attention": {"rope_theta": 5000.0, "rope_type": "default"},
            },
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
        },
    ),
    "granite": Family(
        "GraniteConfig",
        "GraniteForCausalLM",
        "granite",
        {"embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_multiplier": 0.02, "logits_scaling": 4.0},
    ),
    # sliding_window None: llama.cpp disables Phi's window
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", "phi3", {"sliding_window": None}),
    # Phi-4-mini's shape of RoPE: LongRoPE factors over 3/4 of each head; the original context of
    # 16 is below every test's prompt, so transformers uses the long factors, as ubatch does for
    # any context longer than 16 per sequence (the short ones: test_archs)
    "phi3-longrope": Family(
        "Phi3Config",
        "Phi3ForCausalLM",
        "phi3",
        {
            "sliding_window": None,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 16,
            "rope_scaling": {
                "rope_type": "longrope",
                "long_factor": [1.0 + 0.4 * i for i in range(24)],
                "short_factor": [1.0 + 0.03 * i for i in range(24)],
            },
        },
    ),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", "olmo2"),
    # four layers: the fourth has no RoPE
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM", "smollm3", {"num_hidden_layers": 4}),
    "llama-yarn": Family(
        "LlamaConfig",
        "LlamaForCausalLM",
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "llama-linear": Family(
        "LlamaConfig", "LlamaForCausalLM", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    ),
}
# mixtures of experts (tests/test_moe.py): 8 experts of FFN width 512 (K-quant blocks fit, unlike n_embd), top-2;
# llama.cpp always normalises qwen3moe's top-k weights, as Qwen3-30B-A3B's config asks
MOE_FAMILIES = {
    "qwen3moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "qwen3moe",
        {
            "head_dim": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 512,
            "norm_topk_prob": True,
        },
    ),
    # alternating sliding (64 cells) and full layers, YaRN as ggml computes it (its correction
    # range rounded: transformers' truncate=True), attention sinks, biases, the clamped SwiGLU
    "gpt-oss": Family(
        "GptOssConfig",
        "GptOssForCausalLM",
        "gpt-oss",
        {
            "head_dim": 64,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
            "attn_implementation": "eager",
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": True,
                "rope_theta": 150000.0,
            },
        },
    ),
    # DeepSeek-V2-Lite's shape, tiny: multi-head latent attention (no q_lora), YaRN with its mscale,
    # one leading dense layer, a shared expert, softmax routing scaled. The converter splits
    # kv_b into attn_k_b / attn_v_b per head (read before it sets num_key_value_heads to 1)
    "deepseek2": Family(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        "deepseek2",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 128,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 256,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 1.5,
            "attn_implementation": "eager",
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "rope_theta": 10000.0,
            },
        },
    ),
    # DeepSeek-V2's (full) attention: q through its low-rank pair q_a / q_a_norm / q_b; two shared
    # experts (transformers' DeepSeek-V2 router ignores norm_topk_prob, so it stays unset)
    "deepseek2-qlora": Family(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        "deepseek2",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": 128,
            "kv_lora_rank": 128,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 2,
            "moe_intermediate_size": 256,
            "first_k_dense_replace": 1,
            "attn_implementation": "eager",
        },
    ),
    # DeepSeek-V3's routing (R1, Kimi K2 and other V3-shaped files): sigmoid scores, the selection
    # bias e_score_correction_bias (random here: transformers' init is zeros) on the choice only,
    # group-limited choice (the best 2 of 4 groups of 4 experts by each group's top-2 sum), the
    # chosen weights renormalised and scaled; q through its low-rank pair, YaRN as V3 has it
    "deepseek2-v3": Family(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        "deepseek2",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": 128,
            "kv_lora_rank": 128,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "head_dim": 32,
            "n_routed_experts": 16,
            "num_experts_per_tok": 3,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 256,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "scoring_func": "sigmoid",  # as DeepSeek-V3's config.json says it; transformers' class assumes it
            "topk_method": "noaux_tc",
            "attn_implementation": "eager",
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            },
        },
    ),
    # Qwen1.5-MoE / Qwen2-57B-A14B's shape: routed experts beside a shared expert whose output is
    # scaled by a sigmoid gate of its own (ffn_gate_inp_shexp); the top-k weights not renormalised
    "qwen2moe": Family(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        "qwen2moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 512,
            "norm_topk_prob": False,
        },
    ),
    # Granite's multipliers with experts (feed_forward_length wide, top-k renormalised) and, as
    # GraniteMoeShared has them, shared experts beside them
    "granitemoe": Family(
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        "granitemoe",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 256,
            "shared_intermediate_size": 512,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.02,
            "logits_scaling": 4.0,
        },
    ),
    # the converter writes rms_norm_eps 1e-5 whatever the config says
    "olmoe": Family(
        "OlmoeConfig",
        "OlmoeForCausalLM",
        "olmoe",
        {"num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5},
    ),
}


def family_of(name: str) -> Family:
    """A dense or a mixture-of-experts family by name."""
    return FAMILIES.get(name) or MOE_FAMILIES[name]


def hf_model(family: str, seed: int = 0, tied: bool = False) -> torch.nn.Module:
    """The family's transformers model in fp32 with seeded random weights: 2 layers, n_embd 256
    (K-quant blocks fit), 4 query heads over 2 KV heads."""
    import transformers

    f = family_of(family)
    kw: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": tied,
    }
    cfg = getattr(transformers, f.config)(**(kw | f.extra))
    torch.manual_seed(seed)
    model = getattr(transformers, f.model)(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a selection bias of the scale of the scores' spread
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
    return model


@cache
def _spm() -> bytes:
    return train_spm(VOCAB)


def write_hf(d: Path, family: str, seed: int = 0, tied: bool = False) -> Path:
    """The checkpoint directory: config.json, model.safetensors (fp32), tokenizer.model."""
    if not (d / "config.json").exists():
        hf_model(family, seed, tied).save_pretrained(d, safe_serialization=True)
        (d / "tokenizer.model").write_bytes(_spm())
    return d


@cache
def llama_cpp_src() -> Path | None:
    """llama.cpp's source folder (its converter and gguf-py), or None where it is not available."""
    if not LLAMA_CPP_TOOL.exists():
        return None
    out = subprocess.run(
        [str(LLAMA_CPP_TOOL)], env={**os.environ, "LLAMA_CPP_SRC": "1"}, capture_output=True, text=True
    )
    src = Path(out.stdout.strip()) if out.returncode == 0 else None
    return src if src is not None and (src / "convert_hf_to_gguf.py").exists() else None


# The converter as llama.cpp ships it, except that a family whose class reads only a BPE
# tokenizer.json (olmo2, gpt-oss, deepseek2) takes the tiny tokenizer.model as the others do: the tests feed token ids.
DRIVER = """
import runpy, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
from conversion.base import TextModel
TextModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
import conversion.gpt_oss
conversion.gpt_oss.GptOssModel.set_vocab = TextModel.set_vocab
import conversion.deepseek
conversion.deepseek.DeepseekV2Model.set_vocab = TextModel.set_vocab
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
"""


def convert_llama_cpp(d: Path, out: Path, outtype: str = "f32", own_vocab: bool = False) -> Path:
    """d converted by llama.cpp's convert_hf_to_gguf.py (with its own gguf-py); `own_vocab`: the
    converter's own choice of tokenizer reader (a BPE tokenizer.json directory)."""
    src = llama_cpp_src()
    assert src is not None
    if not out.exists():
        driver = DRIVER.replace("TextModel.set_vocab = ", "pass  # ") if own_vocab else DRIVER
        cmd = [sys.executable, "-c", driver, str(src), str(d), "--outfile", str(out), "--outtype", outtype]
        cmd += ["--model-name", "tiny"]  # not the family's: llama.cpp keys vocabulary fixes off "phi3" in it
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    return out


def rewrite_gguf(
    src: Path,
    out: Path,
    meta: dict[str, object] | None = None,
    tensors: Callable[[list[Tensor]], list[Tensor]] | None = None,
) -> Path:
    """src written again as out with `meta`'s values in place of its own (each keeps the type
    the file gave it; None drops the key) and its tensors passed through `tensors`, as the
    `gguf` package reads and writes them (data as stored: quantised blocks stay bytes)."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or (meta and name in meta and meta[name] is None):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, meta[name] if meta and name in meta else f.contents(), vtype, sub)
    ts = [Tensor(t.name, t.data, t.tensor_type) for t in r.tensors]
    for t in tensors(ts) if tensors else ts:
        w.add_tensor(t.name, t.data, raw_dtype=t.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@dataclass
class Tensor:
    """One tensor of a GGUF file as rewrite_gguf passes it: data as the gguf package holds it,
    outermost dimension first (quantised types: each row's bytes)."""

    name: str
    data: Any
    ggml_type: Any


def fuse_gate_up_exps(ts: list[Tensor]) -> list[Tensor]:
    """Each layer's ffn_gate_exps and ffn_up_exps as one ffn_gate_up_exps, each expert's gate rows
    then its up rows (what llama.cpp's converter writes with --fuse-gate-up-exps)."""
    import numpy as np

    up = {t.name: t for t in ts if t.name.endswith(".ffn_up_exps.weight")}
    out = []
    for t in ts:
        if t.name.endswith(".ffn_gate_exps.weight"):
            u = up[t.name.replace("gate_exps", "up_exps")]
            out.append(
                Tensor(t.name.replace("gate_exps", "gate_up_exps"), np.concatenate([t.data, u.data], 1), t.ggml_type)
            )
        elif t.name not in up:
            out.append(t)
    return out
