"""A Hugging Face checkpoint directory opened as the GGUFFile its conversion would give.

config.json becomes the converter's metadata keys (config.py), tokenizer.model its
tokenizer keys (tokenizer.py), the safetensors shards its tensors (weights.py).
The model loader then runs unchanged: the same hparams, vocabulary, checks and kernels as for
a GGUF file, and `ubatch convert` writes this same object to disk.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import LlamaFileType

from ubatch.engine.gguf.file import GGUFFile, TensorInfo, open_gguf
from ubatch.engine.gguf.metadata import MetaScalar, MetaValue
from ubatch.engine.model.archs import ARCHS, expected_tensors
from ubatch.engine.model.hf.config import read_config, write_hparams
from ubatch.engine.model.hf.tokenizer import write_tokenizer
from ubatch.engine.model.hf.weights import load_tensors
from ubatch.engine.model.hparams import hparams_from_metadata

FILE_TYPES = {T.F32: LlamaFileType.ALL_F32, T.F16: LlamaFileType.MOSTLY_F16, T.BF16: LlamaFileType.MOSTLY_BF16}


def _plain(value: object, vtype: V) -> MetaValue:
    """A key's value as open_gguf returns it: f32 numbers rounded to f32, token texts as str."""
    if vtype == V.ARRAY and isinstance(value, (list, tuple)):
        return [_scalar(v, isinstance(v, float)) for v in value]
    return _scalar(value, vtype == V.FLOAT32)


def _scalar(v: object, f32: bool) -> MetaScalar:
    """One value the writer holds (a number, bool, str, or a token text as bytes)."""
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8")
    if f32 and isinstance(v, (int, float)):
        return float(np.float32(v))
    if isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"unexpected metadata value {v!r}")


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir()


def open_model_file(path: str | os.PathLike[str]) -> GGUFFile:
    """`-m PATH` opened without loading weights: a checkpoint directory or a GGUF file."""
    return open_checkpoint(path)[0] if is_checkpoint(path) else open_gguf(path)


def open_checkpoint(path: str | os.PathLike[str]) -> tuple[GGUFFile, gguf.GGUFWriter]:
    """The checkpoint as a GGUFFile, plus the (path-less) writer holding its typed keys."""
    d = Path(path)
    arch, cfg = read_config(d)
    src = str(d / "config.json")
    w = gguf.GGUFWriter(None, arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(d.name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_hparams(w, arch, cfg, src)
    vocab_size = cfg.get("vocab_size")
    write_tokenizer(w, d, arch, vocab_size if isinstance(vocab_size, int) else None)
    meta = {k: _plain(v.value, v.type) for k, v in w.kv_data[0].items()}
    hp = hparams_from_metadata(meta, src)
    tensors = load_tensors(d, hp, expected_tensors(hp))
    extra = ARCHS[arch].hf.extra_tensors
    for name, a in (extra(cfg, src) if extra is not None else {}).items():  # computed, as the converter does
        raw = a.reshape(-1).view(np.uint8)
        tensors[name] = TensorInfo(name, int(T.F32), a.shape, raw, raw.nbytes)
    kinds = [t.ggml_type for t in tensors.values() if len(t.shape) == 2]
    main = max(set(kinds), key=kinds.count) if kinds else T.F32
    w.add_file_type(FILE_TYPES[T(main)])
    meta["general.file_type"] = int(FILE_TYPES[T(main)])
    return GGUFFile(d, 3, meta, tensors, 0), w
