"""Write a Hugging Face checkpoint as a GGUF file: `ubatch convert DIR -o FILE.gguf`.

The checkpoint is opened exactly as `-m DIR` opens it (engine/model/hf/checkpoint.py), so the file
holds the keys and tensors the engine runs from the directory: the converter's metadata, Q/K
already permuted, norms as f32. Matrices are written in the chosen type (llama.cpp's
`--outtype`); one already in that type is copied byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.file import TensorInfo
from ubatch.engine.model.hf.checkpoint import open_checkpoint
from ubatch.kernels.quant.quantize import quantize_q8_0

OUTTYPES = {
    "f32": (T.F32, LlamaFileType.ALL_F32),
    "f16": (T.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (T.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}


def as_f32(t: TensorInfo) -> np.ndarray:
    """The tensor's values as f32 (it is stored as F32, F16 or BF16)."""
    if t.ggml_type == T.BF16:
        return (t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
    dtype = np.float16 if t.ggml_type == T.F16 else np.float32
    return t.data.view(dtype).astype(np.float32).reshape(t.shape)


def encode(t: TensorInfo, qtype: int) -> tuple[np.ndarray, int]:
    """(bytes, ggml type) of t in qtype; 1-D tensors stay f32, rows not a multiple of 32 fall back to f16."""
    if len(t.shape) == 1:
        qtype = T.F32
    elif qtype == T.Q8_0 and t.shape[-1] % 32:
        qtype = T.F16
    if qtype == t.ggml_type:
        return t.data, qtype
    x = as_f32(t)
    if qtype == T.F32:
        return x.reshape(-1).view(np.uint8), qtype
    if qtype == T.F16:
        return x.astype(np.float16).reshape(-1).view(np.uint8), qtype
    if qtype == T.BF16:
        return gguf.quants.quantize(x, T.BF16).reshape(-1).view(np.uint8), qtype
    return quantize_q8_0(torch.from_numpy(x)).numpy().reshape(-1), qtype


def convert(
    src: str | Path, out: str | Path, outtype: str = "f16", progress: Callable[[str], None] | None = None
) -> Path:
    """Write checkpoint directory src as GGUF file out; returns out."""
    if outtype not in OUTTYPES:
        raise ModelLoadError(f"--outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    qtype, ftype = OUTTYPES[outtype]
    g, keys = open_checkpoint(src)
    o = Path(out)
    if o.is_dir():
        raise ModelLoadError(f"{o}: is a directory; -o takes the path of the GGUF file to write")
    w = gguf.GGUFWriter(str(o), keys.arch)
    for k, v in keys.kv_data[0].items():
        if k not in ("general.architecture", "general.file_type"):
            w.add_key_value(k, v.value, v.type, v.sub_type)
    w.add_key_value("general.file_type", int(ftype), gguf.GGUFValueType.UINT32)
    for t in g.tensors.values():
        data, ttype = encode(t, qtype)
        w.add_tensor(t.name, data.reshape(*t.shape[:-1], -1), raw_dtype=T(ttype))  # bytes per row
        if progress:
            progress(f"{t.name:32s} {t.type_name:>5s} -> {T(ttype).name:5s} {t.shape}")
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    except OSError as e:
        raise ModelLoadError(f"{o}: cannot write ({e.strerror})") from None
    finally:
        w.close()
    return o
