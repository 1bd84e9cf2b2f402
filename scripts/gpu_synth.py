"""Synthetic GGUF files for scripts/gpu_check.py: real shapes and types, random blocks.

The default model's 250 MB cannot travel to a lent GPU machine (64 MiB a call), so `prepare`
keeps its header (metadata, the 262144-token vocabulary, the tensor table: 6.5 MB) and
`from_header` writes, on the device, a file with that header and random blocks of each
tensor's type at the same offsets. `write_llama_7b` writes a 7B-shaped llama (Q4_K_M-like
types: Q4_K, with Q6_K for attn_v / ffn_down of every other layer and for the output head).
Random blocks: every f16 scale of a block is set to a small finite value so that weights
dequantise to about N(0, 1/cols); norms are 1 + noise. Nothing here needs a GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

# byte offsets of the f16 fields (scales, mins) inside one block of each quantised type
F16_AT = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ3_S: (0,), T.IQ3_XXS: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,),
    T.IQ2_S: (0,), T.IQ1_S: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,),
    T.MXFP4: (), T.IQ1_M: (),  # an E8M0 byte; a scale spread over four words (random_blocks)
}  # fmt: skip


def random_blocks(rng: np.random.Generator, qtype: int, rows: int, cols: int, norm: bool = False) -> np.ndarray:
    """(rows, row bytes) uint8 of a tensor of `qtype` with finite, modest values."""
    qtype = T(qtype)
    if qtype in (T.F32, T.F16, T.BF16):
        x = (
            (1.0 + 0.1 * rng.standard_normal((rows, cols)))
            if norm
            else rng.standard_normal((rows, cols)) / np.sqrt(cols)
        )
        if qtype == T.BF16:
            return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return x.astype(np.float32 if qtype == T.F32 else np.float16).view(np.uint8).reshape(rows, -1)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.array([1.0 / (40.0 * np.sqrt(cols))], dtype=np.float16).view(np.uint8)
    for off in F16_AT[qtype]:
        raw[..., off : off + 2] = scale
    if qtype == T.MXFP4:  # 2^(e - 128) times codes up to 12: about the f16 types' scale times 16
        raw[..., 0] = 128 + round(float(np.log2(1.0 / (40.0 * np.sqrt(cols)))))
    if qtype == T.IQ1_M:  # the scale's top exponent bit clear: finite, below 2
        raw[..., 55] &= 0xBF
    return raw.reshape(rows, -1)


def prepare(model: Path, out_dir: Path) -> Path:
    """Keep `model`'s header bytes and tensor table in out_dir (to carry to the device)."""
    r = gguf.GGUFReader(str(model))
    out_dir.mkdir(parents=True, exist_ok=True)
    with model.open("rb") as f:
        (out_dir / "default.header").write_bytes(f.read(r.data_offset))
    table = [
        {"name": t.name, "type": int(t.tensor_type), "shape": [int(x) for x in reversed(t.shape.tolist())],
         "offset": int(t.data_offset), "nbytes": int(t.n_bytes)}
        for t in r.tensors
    ]  # fmt: skip
    meta = {"source": model.name, "size": model.stat().st_size, "tensors": table}
    (out_dir / "default.json").write_text(json.dumps(meta))
    return out_dir


def from_header(src_dir: Path, out: Path, seed: int = 0) -> Path:
    """A GGUF with the prepared header and random blocks at every tensor's offset."""
    meta = json.loads((src_dir / "default.json").read_text())
    rng = np.random.default_rng(seed)
    with out.open("wb") as f:
        f.write((src_dir / "default.header").read_bytes())
        for t in sorted(meta["tensors"], key=lambda t: t["offset"]):
            shape = t["shape"]
            rows, cols = (1, shape[0]) if len(shape) == 1 else (int(np.prod(shape[:-1])), shape[-1])
            data = random_blocks(rng, t["type"], rows, cols, norm=len(shape) == 1).reshape(-1)
            assert data.size == t["nbytes"], (t["name"], data.size, t["nbytes"])
            f.seek(t["offset"])
            f.write(data.tobytes())
        f.truncate(meta["size"])
    return out


def add_spm_vocab(w: gguf.GGUFWriter, n_vocab: int) -> None:
    """A synthetic SentencePiece vocabulary of `n_vocab` tokens (BOS 1, EOS 2) in the file."""
    w.add_tokenizer_model("llama")
    tokens, scores, types = _vocab(n_vocab)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [f"▁t{i}" for i in range(n - len(tokens))]
    types += [1] * (n - len(types))
    return tokens, [0.0] * 259 + [-float(i) for i in range(n - 259)], types


def write_llama(out: Path, n_embd: int = 4096, n_layer: int = 32, n_head: int = 32, n_head_kv: int = 32,
                n_ff: int = 11008, n_vocab: int = 32000, seed: int = 0, qtype: int = T.Q4_K) -> Path:  # fmt: skip
    """A llama of the given shape (default: 7B) with Q4_K_M-like random blocks; with another
    `qtype` (IQ4_XS, IQ4_NL, MXFP4) every matrix but the output head is of it."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    add_spm_vocab(w, n_vocab)
    kq = qtype if n_embd % GGML_QUANT_SIZES[T(qtype)][0] == 0 else T.Q8_0

    def mat(name: str, rows: int, cols: int, qtype: int) -> None:
        qtype = qtype if cols % GGML_QUANT_SIZES[T(qtype)][0] == 0 else T.Q8_0
        w.add_tensor(name, random_blocks(rng, qtype, rows, cols), raw_dtype=T(qtype))

    def vec(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", n_vocab, n_embd, kq)
    vec("output_norm.weight", n_embd)
    mat("output.weight", n_vocab, n_embd, T.Q6_K if n_embd % 256 == 0 else T.Q8_0)
    dh = n_embd // n_head
    for il in range(n_layer):
        p, hi = f"blk.{il}.", T.Q6_K if il % 2 == 0 and n_embd % 256 == 0 and qtype == T.Q4_K else kq
        vec(p + "attn_norm.weight", n_embd)
        vec(p + "ffn_norm.weight", n_embd)
        mat(p + "attn_q.weight", n_head * dh, n_embd, kq)
        mat(p + "attn_k.weight", n_head_kv * dh, n_embd, kq)
        mat(p + "attn_v.weight", n_head_kv * dh, n_embd, hi)
        mat(p + "attn_output.weight", n_embd, n_head * dh, kq)
        mat(p + "ffn_gate.weight", n_ff, n_embd, kq)
        mat(p + "ffn_up.weight", n_ff, n_embd, kq)
        mat(p + "ffn_down.weight", n_embd, n_ff, hi)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


if __name__ == "__main__":  # python scripts/gpu_synth.py prepare MODEL OUT_DIR | llama OUT TYPE [N_EMBD N_LAYER N_FF]
    if len(sys.argv) == 4 and sys.argv[1] == "prepare":
        print(prepare(Path(sys.argv[2]), Path(sys.argv[3])))
    elif len(sys.argv) in (4, 7) and sys.argv[1] == "llama":
        dims = dict(zip(("n_embd", "n_layer", "n_ff"), map(int, sys.argv[4:]))) if len(sys.argv) == 7 else {}
        heads = dims["n_embd"] // 128 if dims else 32
        print(write_llama(Path(sys.argv[2]), n_head=heads, n_head_kv=heads, qtype=T[sys.argv[3]], **dims))
    else:
        sys.exit(
            "usage: python scripts/gpu_synth.py prepare MODEL.gguf OUT_DIR | llama OUT.gguf TYPE [N_EMBD N_LAYER N_FF]"
        )
