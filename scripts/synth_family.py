"""A GGUF of a real model's shape with random Q4_K_M-like blocks, for any registered architecture.

    python scripts/synth_family.py qwen3-1.7b OUT.gguf
    python scripts/synth_family.py llama-3.2-1b OUT.gguf
    python scripts/synth_family.py qwen3-0.6b OUT.gguf .../llama.cpp/models/ggml-vocab-qwen2.gguf
    python scripts/synth_family.py qwen3-30b-a3b-8l OUT.gguf   # Qwen3-30B-A3B's layers, 8 of its 48
    python scripts/synth_family.py deepseek-v2-lite-6l OUT.gguf   # DeepSeek-V2-Lite's, 6 of its 27
    python scripts/synth_family.py gpt-oss-20b-6l OUT.gguf   # GPT-OSS-20B's, 6 of its 24, MXFP4 experts

The tensors are the architecture's own declarations (engine/model/archs: every layer tensor the
forward reads, by name and shape), so a new family needs only its shape here. Matrices are Q4_K
(Q6_K for attn_v and ffn_down of every other layer), the embedding Q4_K and tied to the output
as in both models (a mixture of experts: its experts as 3-D tensors, ffn_down_exps Q6_K every other
layer, the router F32 as llama-quantize keeps it), norms 1 + noise, biases small (scripts/gpu_synth.py's random blocks).
GPT-OSS is stored as ggml-org/gpt-oss-20b-GGUF's mxfp4 file is: experts MXFP4 (E8M0 block scales of
about 1/(40·sqrt(cols)), as every GPT-OSS GGUF ships them), every other matrix Q8_0 with its own output
head (that file's 12.1 GB is 19.1B expert weights at 4.25 bits and 1.8B others at 8.5), router,
biases and sinks F32, YaRN and the sliding window as its config has them. The
vocabulary is a placeholder SentencePiece one of the model's size, or another file's (VOCAB.gguf,
e.g. llama.cpp's models/ggml-vocab-qwen2.gguf) so that text runs through the real tokenizer. For
speed comparisons (`python scripts/bench_cpu.py -m OUT.gguf`) and end-to-end runs, not for meaning.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gpu_synth import add_spm_vocab, random_blocks

from ubatch.engine.model.archs import expected_tensors
from ubatch.engine.model.hparams import hparams_from_metadata

# name -> (arch, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab, rope_freq_base)
SHAPES = {
    "qwen3-1.7b": ("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, 1_000_000.0),
    "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 1_000_000.0),
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 64, 8192, 128256, 500_000.0),
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 64, 4864, 151936, 1_000_000.0),
    # Qwen3-30B-A3B's layer shapes, 8 of its 48 layers (its n_ff is the unused dense width)
    "qwen3-30b-a3b-8l": ("qwen3moe", 2048, 8, 32, 4, 128, 6144, 151936, 1_000_000.0),
    # DeepSeek-V2-Lite's layer shapes, 6 of its 27 (the first dense): latent attention's head_dim is
    # the compressed row's, kv_lora_rank 512 + 64 RoPE dims (MLA below)
    "deepseek-v2-lite-6l": ("deepseek2", 2048, 6, 16, 1, 576, 10944, 102400, 10000.0),
    # GPT-OSS-20B's layer shapes, 6 of its 24 (o200k_harmony's 201088 tokens; 64 x 64 query heads > n_embd)
    "gpt-oss-20b-6l": ("gpt-oss", 2880, 6, 64, 8, 64, 2880, 201088, 150000.0),
}
# mixtures of experts: name -> (n_expert, n_expert_used, expert FFN width)
EXPERTS = {"qwen3-30b-a3b-8l": (128, 8, 768), "deepseek-v2-lite-6l": (64, 6, 1408), "gpt-oss-20b-6l": (32, 4, 2880)}
# files stored as the GPT-OSS GGUFs are (MXFP4 experts, Q8_0 elsewhere, an untied output head)
# with their config's extra keys: name -> (context length, rms eps, sliding window, YaRN factor, YaRN's original context)
MXFP4_FILES = {"gpt-oss-20b-6l": (131072, 1e-5, 128, 32.0, 4096)}
# latent attention: name -> (kv_lora_rank, RoPE dims, q·k head width, value head width, shared experts, dense layers)
MLA = {"deepseek-v2-lite-6l": (512, 64, 192, 128, 2, 1)}


def write(name: str, out: Path, seed: int = 0, vocab: Path | None = None) -> Path:
    """The file; with `vocab`, that GGUF's tokenizer keys (e.g. llama.cpp's models/ggml-vocab-qwen2.gguf)
    and its size, so that text goes through the real tokenizer end to end."""
    arch, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab, base = SHAPES[name]
    src = gguf.GGUFReader(vocab) if vocab is not None else None
    if src is not None:
        n_vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), arch)
    n_ctx, eps = (MXFP4_FILES[name][:2]) if name in MXFP4_FILES else (4096, 1e-6)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if name in MLA:
        kv_lora, rot, k_mla, v_mla, n_shared, n_dense = MLA[name]
        w.add_key_length(kv_lora + rot)
        w.add_value_length(kv_lora)
        w.add_rope_dimension_count(rot)
        w.add_kv_lora_rank(kv_lora)
        w.add_key_length_mla(k_mla)
        w.add_value_length_mla(v_mla)
        w.add_expert_shared_count(n_shared)
        w.add_leading_dense_block_count(n_dense)
        w.add_uint32(f"{arch}.attention.q_lora_rank", 0)  # llama.cpp wants the key unless the model has 26/27 layers
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(base)
    if name in MXFP4_FILES:
        _, _, n_swa, yarn, n_ctx_orig = MXFP4_FILES[name]
        w.add_sliding_window(n_swa)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn)
        w.add_rope_scaling_orig_ctx_len(n_ctx_orig)
    if name in EXPERTS:
        n_expert, n_used, n_ff_exp = EXPERTS[name]
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(n_ff_exp)
    if src is not None:
        for key, field in src.fields.items():
            if key.startswith("tokenizer."):
                vtype = field.types[0]
                value = field.contents()
                w.add_key_value(key, value, vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    else:
        add_spm_vocab(w, n_vocab)
    meta = {k: v.value for k, v in w.kv_data[0].items() if not k.startswith("tokenizer.")}
    hp = hparams_from_metadata(meta | {f"{arch}.vocab_size": n_vocab}, name)
    mxfp4 = name in MXFP4_FILES
    for spec in expected_tensors(hp).values():
        if not spec.required and not (mxfp4 and spec.name == "output.weight"):
            continue  # tied output, no rope scaling tables
        if len(spec.shape) == 1 or spec.kind == "bias":  # expert biases are (n_expert, rows)
            x = 0.1 * rng.standard_normal(spec.shape) + (0.0 if spec.kind == "bias" else 1.0)
            w.add_tensor(spec.name, x.astype(np.float32))
            continue
        n_mat, (rows, cols) = (spec.shape[0] if len(spec.shape) == 3 else 1), spec.shape[-2:]
        il = int(spec.name.split(".")[1]) if spec.name.startswith("blk.") else 0
        heavy = spec.name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")) and il % 2 == 0
        qtype = T.Q6_K if heavy else T.Q4_K
        if cols % 256 or mxfp4:
            qtype = T.MXFP4 if mxfp4 and spec.kind == "experts" else T.Q8_0
        if spec.name.endswith("ffn_gate_inp.weight"):
            qtype = T.F32
        blocks = random_blocks(rng, qtype, n_mat * rows, cols)
        w.add_tensor(spec.name, blocks.reshape(*spec.shape[:-1], -1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in SHAPES:
        sys.exit(f"usage: python scripts/synth_family.py {{{','.join(SHAPES)}}} OUT.gguf [VOCAB.gguf]")
    print(write(sys.argv[1], Path(sys.argv[2]), vocab=Path(sys.argv[3]) if len(sys.argv) == 4 else None))
