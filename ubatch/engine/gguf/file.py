"""Open a GGUF file (memory-mapped) and turn every failure into a one-line ModelLoadError.

We parse the header ourselves rather than with `gguf.GGUFReader`: the reader builds a numpy view
per string, which takes ~8 s for Gemma 3's 262,144-token vocabulary; this parser takes ~0.3 s.
The `gguf` package still supplies the type constants (block sizes), writes the test models and
is the reference for dequantisation.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.metadata import Metadata, MetaScalar, MetaValue, bad_value, is_int
from ubatch.engine.gguf.string_array import StringArray

GGUF_MAGIC = b"GGUF"

# value type code -> (struct format, size) for scalars (see reference/gguf-models.md §1.1)
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NP_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
LARGE_ARRAY = 4096  # arrays longer than this (token texts, scores, types) stay compact: numpy / StringArray


@dataclass(slots=True)
class TensorInfo:
    """One tensor as stored. `shape` is torch order (outermost first) = reversed GGUF ne."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: npt.NDArray[np.uint8]  # zero-copy view of the tensor's bytes
    n_bytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"


@dataclass(slots=True)
class GGUFFile:
    """Metadata (key -> Python value) and tensor infos of one GGUF file."""

    path: Path
    version: int
    metadata: Metadata
    tensors: dict[str, TensorInfo]
    data_offset: int


class _Cursor:
    """Little-endian reader over a bytes-like buffer; raises EOFError past the end."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str, size: int) -> bool | int | float:
        if self.pos + size > len(self.buf):
            raise EOFError
        v: bool | int | float = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def take(self, fmt: str, size: int) -> int:
        """An integer field (`fmt` an integer format)."""
        return int(self.scalar(fmt, size))

    def string(self) -> str:
        n = self.take("<Q", 8)
        if self.pos + n > len(self.buf):
            raise EOFError
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> MetaValue:
        if vtype in _SCALARS:
            return self.scalar(*_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I", 4), self.take("<Q", 8)
            if count * (8 if etype == _STRING else 1) > len(self.buf) - self.pos:
                raise EOFError  # bounded by the bytes left before anything is read or built
            if etype == _STRING and count > LARGE_ARRAY:  # a vocabulary: one blob, no str per token
                texts, self.pos = StringArray.parse(self.buf, self.pos, count)
                return texts
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _NP_SCALARS:
                size = _SCALARS[etype][1] * count
                if self.pos + size > len(self.buf):
                    raise EOFError
                arr: npt.NDArray[np.generic] = np.frombuffer(
                    self.buf, dtype=_NP_SCALARS[etype], count=count, offset=self.pos
                )
                self.pos += size
                if count > LARGE_ARRAY and etype != 7:  # vocab-sized: a compact copy, no Python objects
                    return arr.copy()
                items: list[MetaScalar] = (arr.astype(bool) if etype == 7 else arr).tolist()
                return items
            raise ValueError(f"unsupported array element type {etype}")
        raise ValueError(f"unknown value type {vtype}")


def _drop_header_pages(mmo: mmap.mmap, data_offset: int) -> None:
    """The header (6 MiB for a 262,144-token vocabulary) was copied out while parsing: hand its
    file pages back rather than keep them resident beside the weights. Only whole pages before
    the first tensor byte are dropped; nothing was written there, so a later read re-faults them."""
    n = data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    if n and hasattr(mmap, "MADV_DONTNEED"):
        mmo.madvise(mmap.MADV_DONTNEED, 0, n)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF header and map its tensors; raise ModelLoadError naming file and problem."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file; pass -m with the path of a .gguf model")
    if p.is_dir():
        raise ModelLoadError(f"{p}: is a directory; pass -m with the path of a .gguf model file")
    try:
        size = p.stat().st_size
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{p}: cannot read ({e.strerror}); check the path and permissions") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{p}: not a GGUF file (bad magic {magic!r}); pass a .gguf model")
    with p.open("rb") as f:  # copy-on-write: torch views need writable arrays
        mmo = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mm = np.frombuffer(mmo, np.uint8)
    cur = _Cursor(mm.data)
    cur.pos = 4
    try:
        version = cur.take("<I", 4)
        if version & 0xFFFF == 0:
            raise ModelLoadError(f"{p}: big-endian GGUF files are not supported (llama.cpp refuses them too)")
        if version not in (2, 3):
            raise ModelLoadError(f"{p}: unsupported GGUF version {version}; convert it with a current llama.cpp")
        n_tensors, n_kv = cur.take("<q", 8), cur.take("<q", 8)
        # a key takes at least 13 bytes (name length, type, a 1-byte value), a tensor info 32
        if not 0 <= n_kv <= (size - cur.pos) // 13 or not 0 <= n_tensors <= (size - cur.pos) // 32:
            raise ModelLoadError(
                f"{p}: truncated or corrupt GGUF header ({n_tensors:,} tensors and {n_kv:,} keys cannot fit in {size:,} bytes); re-download the file"
            )
        metadata: Metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            if key in metadata:
                raise ValueError(f"duplicate key {key!r}")
            metadata[key] = cur.value(cur.take("<I", 4))
        infos = []
        names: set[str] = set()
        for _ in range(n_tensors):
            name = cur.string()
            if name in names:
                raise ValueError(f"duplicate tensor {name!r}")
            names.add(name)
            n_dims = cur.take("<I", 4)
            if not 1 <= n_dims <= 4:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions (1 to 4 allowed)")
            ne = [cur.take("<q", 8) for _ in range(n_dims)]
            if any(x < 0 for x in ne):
                raise ValueError(f"tensor {name!r} has a negative dimension {ne}")
            infos.append((name, ne, cur.take("<I", 4), cur.take("<Q", 8)))
    except ModelLoadError:
        raise
    except EOFError:
        raise ModelLoadError(f"{p}: truncated GGUF header ({size:,} bytes); re-download the file") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{p}: corrupt GGUF header ({e}); re-download the file") from None

    alignment = metadata.get("general.alignment", 32)
    if not is_int(alignment) or alignment <= 0 or alignment & (alignment - 1):
        raise bad_value(str(p), "general.alignment", alignment, "a power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    _drop_header_pages(mmo, data_offset)
    tensors: dict[str, TensorInfo] = {}
    for name, ne, ttype, offset in infos:
        if ttype not in GGML_QUANT_SIZES:
            raise ModelLoadError(f"{p}: tensor {name!r} has unknown ggml type {ttype}")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        n_el = math.prod(ne)
        if ne and ne[0] % block:
            raise ModelLoadError(f"{p}: tensor {name!r}: row length {ne[0]} is not a multiple of {block}")
        n_bytes = n_el // block * type_size
        if offset % alignment:
            raise ModelLoadError(
                f"{p}: tensor {name!r}: data offset {offset} is not a multiple of {alignment}; the file is corrupt"
            )
        start = data_offset + offset
        if start + n_bytes > size:  # also what bounds absurd dimensions: nothing is sized from them
            raise ModelLoadError(
                f"{p}: truncated or corrupt file: tensor {name!r} of shape {tuple(reversed(ne))} needs bytes up to {start + n_bytes:,} but the file has {size:,}; re-download or re-assemble it"
            )
        shape = tuple(int(x) for x in reversed(ne))
        tensors[name] = TensorInfo(name, ttype, shape, mm[start : start + n_bytes], n_bytes)
    return GGUFFile(p, version, metadata, tensors, data_offset)
