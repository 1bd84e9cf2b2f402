"""A checkpoint's safetensors shards as GGUF-named tensors: memory-mapped, in their stored dtype.

Names are mapped to the GGUF names, every tensor is checked against the shapes the config
implies before any is used, and the converter's changes are applied: llama's Q/K rows permuted
from HF's rotate-half order to GGUF's interleaved RoPE pairs, gemma's RMSNorm weights stored as
1 + w, 1-D tensors kept as f32, and embedding rows past the vocabulary dropped, each where the
architecture's table (engine/model/archs) says so. Every
other tensor stays a zero-copy view of its file.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.file import TensorInfo
from ubatch.engine.model.archs import ARCHS
from ubatch.engine.model.archs.base import HParams, TensorSpec

DTYPES = {"F32": (T.F32, np.float32), "F16": (T.F16, np.float16), "BF16": (T.BF16, np.uint16)}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_SKIP = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^(model\.)?(vision_tower|multi_modal_projector)\.")
# a Gemma3ForConditionalGeneration's text model, as older and newer transformers name it
_TEXT_PREFIX = re.compile(r"^(language_model\.|model\.language_model\.)")


def gguf_name(hf: str, arch: str) -> str | None:
    """The GGUF name of HF tensor `hf`, or None when the engine has no such tensor."""
    stem, _, kind = _TEXT_PREFIX.sub(lambda m: "" if m[0].startswith("language") else "model.", hf).rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.weight" if kind == "weight" else None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    if m is None:
        return None
    part = ARCHS[arch].hf.layer_names.get(m[2])
    return f"blk.{int(m[1])}.{part}.{kind}" if part else None


def _header(f: Path) -> tuple[dict, int]:
    """The safetensors JSON header of f and where its data starts."""
    try:
        with f.open("rb") as fh:
            raw = fh.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 2 <= n <= min(f.stat().st_size - 8, 1 << 27):
                raise ValueError("bad header length")
            head = json.loads(fh.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{f}: not a safetensors file ({e}); re-download it") from None
    head.pop("__metadata__", None)
    return head, 8 + n


def shard_files(d: Path) -> dict[str, Path]:
    """HF tensor name -> shard file, from model.safetensors.index.json or the lone safetensors file."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = {str(k): d / str(v) for k, v in wm.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from None
        for f in sorted(set(names.values())):
            if not f.is_file():
                raise ModelLoadError(f"{index}: names shard {f.name}, which is missing; download every shard")
        return names
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d}: no *.safetensors weights (and no model.safetensors.index.json)")
    if len(files) > 1:
        raise ModelLoadError(f"{d}: {len(files)} safetensors files but no model.safetensors.index.json to join them")
    return dict.fromkeys(_header(files[0])[0], files[0])


def _to_f32(a: np.ndarray, ggml_type: int) -> np.ndarray:
    if ggml_type == T.BF16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _norm(a: np.ndarray, ggml_type: int, shift: bool) -> np.ndarray:
    """A 1-D tensor as f32; gemma3's norms as 1 + w, added in f16 for f16 weights as the converter does."""
    if ggml_type == T.F16:
        return (a + np.float16(1) if shift else a).astype(np.float32)
    return _to_f32(a, ggml_type) + np.float32(1 if shift else 0)


def _permute(a: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k rows (each head's first half of the rotary pairs, then the second) to GGUF's pairs."""
    rows = a.shape[0]
    return a.reshape(n_head, 2, rows // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def load_tensors(d: Path, hp: HParams, expected: dict[str, TensorSpec]) -> dict[str, TensorInfo]:
    """The GGUF-named tensors of checkpoint d, every one checked before any is mapped."""
    where = shard_files(d)
    table = ARCHS[hp.arch].hf
    heads = {f: _header(f) for f in sorted(set(where.values()))}
    plan: dict[str, tuple[str, Path]] = {}
    for hf, f in where.items():
        name = gguf_name(hf, hp.arch)
        if name is None:
            if _SKIP.search(hf):
                continue
            raise ModelLoadError(f"{f.name}: tensor {hf!r} is not part of a {hp.arch} text model; not supported")
        if hf not in heads[f][0]:
            raise ModelLoadError(f"{f.name}: tensor {hf!r}, named by the index, is not in the file; re-download it")
        plan[name] = (hf, f)
    for name, spec in expected.items():
        if spec.required and name not in plan:
            raise ModelLoadError(
                f"{d}: tensor {name!r} is missing from the safetensors files; the checkpoint is incomplete"
            )
    out: dict[str, TensorInfo] = {}
    for name, (hf, f) in plan.items():
        head, base = heads[f]
        e = head[hf]
        shape = tuple(int(x) for x in e.get("shape", ()))
        want = expected[name].shape if name in expected else None
        if name == "token_embd.weight" and table.trim_vocab and len(shape) == 2 and shape[0] > hp.n_vocab:
            shape = (hp.n_vocab, shape[1])  # rows past the vocabulary (padding) are dropped
        if want is None:
            raise ModelLoadError(f"{f.name}: tensor {hf!r} is not used by a {hp.arch} model of this config")
        if shape != want:
            raise ModelLoadError(f"{f.name}: tensor {hf!r} has shape {shape}, but config.json implies {want}")
        if e.get("dtype") not in DTYPES:
            raise ModelLoadError(
                f"{f.name}: tensor {hf!r} has dtype {e.get('dtype')}; only F32, F16 and BF16 are supported"
            )
        ggml_type, np_dtype = DTYPES[e["dtype"]]
        start, end = (int(x) for x in e["data_offsets"])
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        if end - start < n or base + end > f.stat().st_size:
            raise ModelLoadError(f"{f.name}: tensor {hf!r} runs past the end of the file; re-download it")
        mm = np.memmap(f, dtype=np.uint8, mode="c", offset=base + start, shape=(n,))
        a = mm.view(np_dtype).reshape(shape)
        if len(shape) == 1:
            a, ggml_type = _norm(a, ggml_type, table.norm_shift and name.endswith("norm.weight")), T.F32
        elif table.permute_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = _permute(a, hp.n_head if "attn_q" in name else hp.n_head_kv)
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        out[name] = TensorInfo(name, int(ggml_type), shape, raw, raw.nbytes)
    return out
