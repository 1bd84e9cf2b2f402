"""A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) as the GGUF-named
`.lora_a`/`.lora_b` tensors llama.cpp's convert_lora_to_gguf.py would write: module names mapped
as the base checkpoint's are (weights.py `gguf_name`), llama's Q/K rows of B permuted as the base
rows are, A and B kept in their stored dtype."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.file import TensorInfo
from ubatch.engine.model.archs import ARCHS
from ubatch.engine.model.archs.base import HParams
from ubatch.engine.model.hf.weights import DTYPES, _header, _permute, gguf_name

_PREFIX = "base_model.model."
_KINDS = {".lora_A.weight": "lora_a", ".lora_B.weight": "lora_b"}


def read_peft(d: Path, hp: HParams) -> tuple[float, dict[str, TensorInfo]]:
    """(lora_alpha, tensors by GGUF name) of PEFT directory d, for a base model of hparams hp."""
    try:
        cfg = json.loads((d / "adapter_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{d}: no adapter_config.json; pass a PEFT LoRA directory or a GGUF adapter") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{d}/adapter_config.json: not readable JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{d}: peft_type {cfg.get('peft_type')!r} is not LORA; only LoRA adapters are supported")
    if cfg.get("use_dora") or cfg.get("use_rslora"):
        raise ModelLoadError(
            f"{d}: DoRA and rsLoRA adapters are not supported (llama.cpp's converter refuses them too)"
        )
    alpha = cfg.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ModelLoadError(f"{d}/adapter_config.json: lora_alpha is missing or not a number")
    f = d / "adapter_model.safetensors"
    if not f.is_file():
        raise ModelLoadError(f"{d}: no adapter_model.safetensors; save the adapter with safe_serialization")
    head, base = _header(f)
    table = ARCHS[hp.arch].hf
    out: dict[str, TensorInfo] = {}
    for hf, entry in head.items():
        kind = next((k for k in _KINDS if hf.endswith(k)), None)
        if kind is None:
            if "norm" in hf:  # mergekit's norms: llama.cpp skips them too
                continue
            raise ModelLoadError(f"{f.name}: tensor {hf!r} is neither a lora_A nor a lora_B weight")
        stem = hf.removeprefix(_PREFIX).removesuffix(kind) + ".weight"
        named = gguf_name(stem, hp.arch)
        if named is None or named[1] >= 0:  # one expert's matrix: llama.cpp's LoRA has none either
            raise ModelLoadError(f"{f.name}: module {stem.removesuffix('.weight')!r} is not a {hp.arch} matrix")
        name = named[0]
        if entry.get("dtype") not in DTYPES:
            raise ModelLoadError(f"{f.name}: tensor {hf!r} has dtype {entry.get('dtype')}; only F32, F16 and BF16")
        ggml_type, np_dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(x) for x in entry.get("shape", ()))
        start, end = (int(x) for x in entry["data_offsets"])
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        if len(shape) != 2 or end - start < n or base + end > f.stat().st_size:
            raise ModelLoadError(f"{f.name}: tensor {hf!r} is not a matrix within the file; re-save the adapter")
        a = np.memmap(f, dtype=np.uint8, mode="c", offset=base + start, shape=(n,)).view(np_dtype).reshape(shape)
        if kind == ".lora_B.weight" and table.permute_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = _permute(a, hp.n_head if "attn_q" in name else hp.n_head_kv)
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        key = f"{name}.{_KINDS[kind]}"
        out[key] = TensorInfo(key, int(ggml_type), shape, raw, raw.nbytes)
    return float(alpha), out
