"""A checkpoint's safetensors shards as GGUF-named tensors: memory-mapped, in their stored dtype.

Names are mapped to the GGUF names, every tensor is checked against the shapes the config
implies before any is used, and the converter's changes are applied: llama's Q/K rows permuted
from HF's rotate-half order to GGUF's interleaved RoPE pairs, gemma's RMSNorm weights stored as
1 + w, 1-D tensors kept as f32, and embedding rows past the vocabulary dropped, each where the
architecture's table (engine/model/archs) says so. A mixture of experts' per-expert FFNs are
stacked into the 3-D expert tensors (a copy: the converted GGUF is what maps them), and tensors
the converter rewrites (deepseek2's kv_b, split per head) are rewritten the same way. Every
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


def gguf_name(hf: str, arch: str) -> tuple[str, int] | None:
    """The GGUF name of HF tensor `hf` and, for one expert's FFN matrix, the expert's index in
    the stacked tensor (else -1); None when the engine has no such tensor."""
    hf = hf.removesuffix("_bias") + ".bias" if hf.endswith(".e_score_correction_bias") else hf  # as the converter
    stem, _, kind = _TEXT_PREFIX.sub(lambda m: "" if m[0].startswith("language") else "model.", hf).rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return (f"{_TOP[stem]}.weight", -1) if kind == "weight" else None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    if m is None:
        return None
    table = ARCHS[arch].hf
    if table.experts and kind == "weight":
        e = re.fullmatch(re.escape(table.experts) + r"\.(\d+)\.(gate|up|down)_proj", m[2])
        if e is not None:
            return f"blk.{int(m[1])}.ffn_{e[2]}_exps.weight", int(e[1])
    part = table.layer_names.get(m[2])
    return (f"blk.{int(m[1])}.{part}.{kind}", -1) if part else None


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
    stacks: dict[str, dict[int, tuple[str, Path]]] = {}  # a stacked expert tensor's experts
    for hf, f in where.items():
        named = gguf_name(hf, hp.arch)
        if named is None:
            if _SKIP.search(hf):
                continue
            raise ModelLoadError(f"{f.name}: tensor {hf!r} is not part of a {hp.arch} text model; not supported")
        if hf not in heads[f][0]:
            raise ModelLoadError(f"{f.name}: tensor {hf!r}, named by the index, is not in the file; re-download it")
        name, e = named
        if e >= 0:
            stacks.setdefault(name, {})[e] = (hf, f)
        else:
            plan[name] = (hf, f)
    made = set(plan) | set(stacks)  # and what the rewrites will make of their tensors
    for name in plan:
        layer, stem = _layer_stem(name)
        made |= {f"{layer}{s}.weight" for s in table.rewrites[stem].stems} if stem in table.rewrites else set()
    for name, spec in expected.items():
        if spec.required and name not in made:
            raise ModelLoadError(
                f"{d}: tensor {name!r} is missing from the safetensors files; the checkpoint is incomplete"
            )
    out: dict[str, TensorInfo] = {}

    def add(name: str, a: np.ndarray, ggml_type: int, hf: str, where: str) -> None:
        want = expected[name].shape if name in expected else None
        if want is None:
            raise ModelLoadError(f"{where}: tensor {hf!r} is not used by a {hp.arch} model of this config")
        if a.shape != want:
            raise ModelLoadError(f"{where}: tensor {hf!r} has shape {a.shape}, but config.json implies {want}")
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        out[name] = TensorInfo(name, int(ggml_type), a.shape, raw, raw.nbytes)

    for name, (hf, f) in plan.items():
        a, ggml_type = _mapped(f, heads[f], hf, hp, table.trim_vocab and name == "token_embd.weight")
        layer, stem = _layer_stem(name)
        if len(a.shape) == 1:
            a, ggml_type = _norm(a, ggml_type, table.norm_shift and name.endswith("norm.weight")), T.F32
        elif table.permute_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = _permute(a, hp.n_head if "attn_q" in name else hp.n_head_kv)
        elif stem in table.rewrites:  # the converter's rewrite, checked against what it makes
            for s, b in table.rewrites[stem].fn(a, hp).items():
                add(f"{layer}{s}.weight", b, ggml_type, hf, f.name)
            continue
        add(name, a, ggml_type, hf, f.name)
    n_expert = hp.moe.n_expert if hp.moe else 0
    for name, experts in stacks.items():
        if sorted(experts) != list(range(n_expert)):
            odd = sorted(set(range(n_expert)) ^ set(experts))
            raise ModelLoadError(f"{d}: {name} takes experts 0-{n_expert - 1}; expert {odd[0]} is missing or extra")
        parts = [_mapped(f, heads[f], hf, hp, False) for hf, f in (experts[e] for e in range(n_expert))]
        if len({(p.shape, p.dtype, t) for p, t in parts}) != 1:
            raise ModelLoadError(f"{d}: the experts of {name} differ in shape or dtype; the checkpoint is corrupt")
        stacked = np.empty((n_expert, *parts[0][0].shape), parts[0][0].dtype)  # the converter's torch.stack
        for e, (p, _) in enumerate(parts):
            stacked[e] = p
        add(name, stacked, parts[0][1], experts[0][0], experts[0][1].name)
    return out


def _layer_stem(name: str) -> tuple[str, str]:
    """(`blk.N.`, stem) of a layer weight's GGUF name; ("", "") for any other name."""
    m = re.fullmatch(r"(blk\.\d+\.)(.+)\.weight", name)
    return (m[1], m[2]) if m else ("", "")


def _mapped(f: Path, head: tuple[dict, int], hf: str, hp: HParams, trim_vocab: bool) -> tuple[np.ndarray, int]:
    """HF tensor `hf` of shard f as a memory-mapped array in its stored dtype, and its ggml type;
    with `trim_vocab`, embedding rows past the vocabulary (padding) dropped."""
    e, base = head[0][hf], head[1]
    shape = tuple(int(x) for x in e.get("shape", ()))
    if trim_vocab and len(shape) == 2 and shape[0] > hp.n_vocab:
        shape = (hp.n_vocab, shape[1])
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
    return mm.view(np_dtype).reshape(shape), int(ggml_type)
