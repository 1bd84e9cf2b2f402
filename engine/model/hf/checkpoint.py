"""A Hugging Face checkpoint directory opened as the GGUFFile its conversion would give.

config.json becomes the converter's metadata keys (engine/hf_config.py), tokenizer.model its
tokenizer keys (engine/hf_tokenizer.py), the safetensors shards its tensors (engine/hf_weights.py).
The model loader then runs unchanged: the same hparams, vocabulary, checks and kernels as for
a GGUF file, and `ubatch convert` writes this same object to disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import LlamaFileType

from ubatch.engine.gguf.file import GGUFFile, open_gguf
from ubatch.engine.model.hf.config import read_config, write_hparams
from ubatch.engine.model.hf.tokenizer import write_tokenizer
from ubatch.engine.model.hf.weights import load_tensors
from ubatch.engine.model.hparams import hparams_from_metadata

FILE_TYPES = {T.F32: LlamaFileType.ALL_F32, T.F16: LlamaFileType.MOSTLY_F16, T.BF16: LlamaFileType.MOSTLY_BF16}


def _plain(value: Any, vtype: V) -> Any:
    """A key's value as open_gguf returns it: f32 numbers rounded to f32, token texts as str."""
    if vtype == V.FLOAT32:
        return float(np.float32(value))
    if vtype == V.ARRAY:
        items = [v.decode("utf-8") if isinstance(v, (bytes, bytearray)) else v for v in value]
        return [float(np.float32(v)) if isinstance(v, float) else v for v in items]
    return value


def is_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir()


def open_model_file(path: str | Path) -> GGUFFile:
    """`-m PATH` opened without loading weights: a checkpoint directory or a GGUF file."""
    return open_checkpoint(path)[0] if is_checkpoint(path) else open_gguf(path)


def open_checkpoint(path: str | Path) -> tuple[GGUFFile, gguf.GGUFWriter]:
    """The checkpoint as a GGUFFile, plus the (path-less) writer holding its typed keys."""
    d = Path(path)
    arch, cfg = read_config(d)
    src = str(d / "config.json")
    w = gguf.GGUFWriter(None, arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(d.name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_hparams(w, arch, cfg, src)
    write_tokenizer(w, d, arch, cfg.get("vocab_size"))
    meta = {k: _plain(v.value, v.type) for k, v in w.kv_data[0].items()}
    hp = hparams_from_metadata(meta, src)
    from ubatch.engine.model.model import expected_tensors

    tensors = load_tensors(d, hp, expected_tensors(hp))
    kinds = [t.ggml_type for t in tensors.values() if len(t.shape) == 2]
    main = max(set(kinds), key=kinds.count) if kinds else T.F32
    w.add_file_type(FILE_TYPES[T(main)])
    meta["general.file_type"] = int(FILE_TYPES[T(main)])
    return GGUFFile(d, 3, meta, tensors, 0), w
