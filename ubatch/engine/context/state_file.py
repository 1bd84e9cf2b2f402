"""A sequence's saved state as bytes: a safetensors file with a small string header.

The tensors are the cells of one sequence (per KV cache: positions, pending shifts, then the K
and V rows of every layer in the cache type) plus its token ids; the header describes the model
field by field (`ModelId`, so a mismatch can say what differs), the cache types and sizes and the
format version. Reading checks that the file is a regular file whose size is exactly what its
header declares before the body is read; whether the state fits a given context is
`engine/context/state.py`'s job.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import stat
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType, LlamaFileType

from ubatch.engine.errors import ContextError
from ubatch.engine.gguf.metadata import MetaValue
from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.model.model import Model

FORMAT = "ubatch-seq-state"
VERSION = 2  # 2: the model described field by field (1 held only a hash)
MAX_HEADER = 16 << 20  # a state's JSON header is a few KB; safetensors itself stops at 100 MB
READ_CHUNK = 1 << 30  # one read() call returns at most ~2 GB on Linux
DIMS = ("n_vocab", "n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "n_embd_head_k", "n_embd_head_v")
SHOWN_KEYS = ("general.name", "general.architecture", "general.file_type")  # compared as fields


class StateError(ContextError):
    """A state that cannot be read or restored here; the message is one line for the user."""


@dataclass
class SeqState:
    """One sequence's cells and tokens, with the header that says where they came from."""

    header: dict[str, str]
    tokens: list[int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ModelId:
    """What makes two models the same for a KV cache, kept as separate fields (not one hash) so
    that a refused state can say which of them differ. Every field is a string, as a safetensors
    header holds them; the hashes are short hex digests."""

    arch: str
    name: str
    file_type: str  # general.file_type as llama.cpp names it (Q4_K_M), or "unset"
    tensor_types: str  # "12 Q8_0, 5 F32": how many tensors of each type
    n_tensors: str
    dims: dict[str, str]  # DIMS -> value
    table: str  # hash of every tensor's name, type and shape
    meta: dict[str, str]  # metadata key -> hash of its value
    hparams: str  # hash of the hyperparameters as loaded (after any override)
    weights: str  # hash of the first bytes of every tensor: a fine-tune with the same shapes differs

    def to_header(self) -> dict[str, str]:
        h = {f"model_{k}": v for k, v in asdict(self).items() if isinstance(v, str)}
        h.update({f"model_{k}": v for k, v in self.dims.items()})
        h["model_meta"] = json.dumps(self.meta, sort_keys=True, separators=(",", ":"))
        h["model"] = _digest(json.dumps(h, sort_keys=True).encode())
        return h

    @classmethod
    def from_header(cls, h: dict[str, str]) -> ModelId:
        """The fields a state's header holds ("?" where one is missing: a damaged header)."""
        try:
            raw = json.loads(h.get("model_meta", "{}"))
        except ValueError:
            raw = {}
        meta = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
        strs = {k: h.get(f"model_{k}", "?") for k in cls.__dataclass_fields__ if k not in ("dims", "meta")}
        return cls(**strs, dims={d: h.get(f"model_{d}", "?") for d in DIMS}, meta=meta)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _value_digest(v: MetaValue) -> str:
    """A metadata value's hash over its exact content (large arrays as their raw bytes)."""
    if isinstance(v, StringArray):
        return _digest(v.blob + np.asarray(v.offsets, dtype=np.int64).tobytes())
    if isinstance(v, np.ndarray):
        return _digest(str(v.dtype).encode() + np.ascontiguousarray(v).tobytes())
    return _digest(repr(v).encode())


def _file_type(value: MetaValue | None) -> str:
    if value is None:
        return "unset"
    try:
        return LlamaFileType(int(str(value))).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file type {value}"


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def model_id(model: Model) -> ModelId:
    g, hp = model.gguf, model.hparams
    counts = Counter(_type_name(t.ggml_type) for t in g.tensors.values())
    table, weights = hashlib.sha256(), hashlib.sha256()
    for name, t in sorted(g.tensors.items()):
        table.update(f"{name}:{t.ggml_type}:{tuple(t.shape)}\n".encode())
        weights.update(np.asarray(t.data).reshape(-1)[:64].tobytes())
    return ModelId(
        arch=hp.arch,
        name=model.name,
        file_type=_file_type(g.metadata.get("general.file_type")),
        tensor_types=", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kn: (-kn[1], kn[0]))),
        n_tensors=str(len(g.tensors)),
        dims={d: str(getattr(hp, d)) for d in DIMS},
        table=table.hexdigest()[:16],
        meta={k: _value_digest(v) for k, v in sorted(g.metadata.items())},
        hparams=_digest(repr(hp).encode()),
        weights=weights.hexdigest()[:16],
    )


def differences(saved: ModelId, mine: ModelId) -> list[str]:
    """What differs between the model a state was saved with and this one, as "X differs (saved
    vs this one)" phrases, most telling first; hashes are named only when nothing shown explains
    the difference."""
    out: list[str] = []

    def cmp(what: str, a: str, b: str, verb: str = "differs") -> bool:
        if a != b:
            out.append(f"{what} {verb} ({a} vs {b})")
        return a != b

    cmp("architecture", saved.arch, mine.arch)
    cmp("model name", saved.name, mine.name)
    if not cmp("file type", saved.file_type, mine.file_type):
        cmp("tensor types", saved.tensor_types, mine.tensor_types, "differ")
    cmp("tensor count", saved.n_tensors, mine.n_tensors)
    for d in DIMS:
        cmp(d, saved.dims.get(d, "?"), mine.dims.get(d, "?"))
    if saved.table != mine.table and not out:
        out.append("tensor names or shapes differ")
    if saved.arch == mine.arch:
        keys = sorted(k for k in saved.meta.keys() | mine.meta.keys() if saved.meta.get(k) != mine.meta.get(k))
        keys = [k for k in keys if k not in SHOWN_KEYS]
        if keys:
            more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
            out.append(f"metadata differs ({', '.join(keys[:4])}{more})")
    if saved.hparams != mine.hparams and not out:
        out.append("hyperparameters differ (a metadata override?)")
    if saved.weights != mine.weights and not out:
        out.append("tensor data differs (same shapes and metadata: a fine-tune or another conversion)")
    return out or ["the model's description differs"]


def to_bytes(state: SeqState) -> bytes:
    from safetensors.torch import save

    tensors = {k: v.contiguous() for k, v in state.tensors.items()}
    tensors["tokens"] = torch.tensor(state.tokens, dtype=torch.int32)
    meta = dict(state.header, format=FORMAT, version=str(VERSION))
    return save(tensors, metadata=meta)


def from_bytes(data: bytes, src: str = "state") -> SeqState:
    """Parse a state; anything that is not a whole state of this format is one StateError."""
    from safetensors.torch import load

    n = _header_len(data[:8], len(data), src)
    meta = _header(data[8 : 8 + n], len(data), src)
    try:
        tensors = load(data)
    except Exception as e:  # safetensors raises its own error types for damaged payloads
        raise StateError(f"{src}: not a readable state file ({e})".splitlines()[0]) from None
    tok = tensors.pop("tokens", None)
    if tok is None or tok.dim() != 1:
        raise StateError(f"{src}: the state file has no token list")
    return SeqState(meta, [int(t) for t in tok.tolist()], tensors)


def _header_len(first: bytes, size: int, src: str) -> int:
    """The JSON header's declared length, from the first 8 bytes of a state of `size` bytes."""
    if size < 8:
        raise StateError(f"{src}: not a state file (too short: {size} bytes)")
    n = int.from_bytes(first[:8], "little")
    if not 0 < n <= MAX_HEADER:  # (the value is not shown: it is the first 8 bytes of any file named)
        raise StateError(f"{src}: not a state file (it does not start with a safetensors header length)")
    if 8 + n > size:
        raise StateError(f"{src}: not a state file, or truncated (its header runs past the file's {size} bytes)")
    return n


def _header(raw: bytes, size: int, src: str) -> dict[str, str]:
    """The safetensors JSON header's metadata, checked (format, version, and that the tensor
    table ends exactly at the end of the `size` bytes) before the tensors are touched."""
    try:
        head = json.loads(raw)
    except ValueError:
        raise StateError(f"{src}: not a state file (its header is not JSON)") from None
    meta = head.get("__metadata__") if isinstance(head, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateError(f"{src}: not a ubatch state file")
    version = str(meta.get("version"))
    if version != str(VERSION):
        if version.isdigit() and int(version) < VERSION:
            raise StateError(f"{src}: written by an older ubatch (state format {version}); re-create it")
        raise StateError(f"{src}: state format {version} is not supported (this ubatch reads {VERSION}); re-create it")
    try:
        spans = [(int(t["data_offsets"][0]), int(t["data_offsets"][1])) for k, t in head.items() if k != "__metadata__"]
    except (KeyError, TypeError, ValueError, IndexError):
        raise StateError(f"{src}: not a state file (its tensor table is malformed)") from None
    if any(not 0 <= a <= b for a, b in spans):
        raise StateError(f"{src}: not a state file (its tensor table is malformed)")
    expected = 8 + len(raw) + max((b for _, b in spans), default=0)
    if expected > size:
        raise StateError(f"{src}: the state file is truncated ({size} bytes, its header declares {expected})")
    if expected < size:
        raise StateError(f"{src}: the state file has {size - expected} bytes past its end (damaged); re-create it")
    return {str(k): str(v) for k, v in meta.items()}


def _not_regular(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return None if stat.S_ISREG(mode) else "not a regular file"


def write_file(path: str | os.PathLike[str], state: SeqState) -> int:
    """Write atomically (a temporary file renamed over the target); returns the bytes written.
    A target that exists and is not a regular file (a device, a directory) is refused, not replaced."""
    name = os.fspath(path)
    try:
        what = _not_regular(os.stat(name).st_mode)
    except OSError:
        what = None
    if what:
        raise StateError(f"cannot write state file {name}: it is {what}; give a regular file's path")
    data = to_bytes(state)
    tmp = None
    try:  # a short temporary name beside the target: a target name near the 255-byte limit still fits
        fd, tmp = tempfile.mkstemp(prefix=".ubatch-", suffix=".tmp", dir=os.path.dirname(name) or ".")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise StateError(f"cannot write state file {name}: {e.strerror}") from None
    return len(data)


def read_file(
    path: str | os.PathLike[str], src: str | None = None, follow_symlinks: bool = True
) -> tuple[SeqState, int]:
    """The state in a file and its size in bytes; messages name the file as `src` (default the
    path). The file must be regular and exactly as long as its header declares, both checked from
    its size and its first bytes before the body is read (with reads bounded by that size).
    `follow_symlinks=False` (the server's slot files, named by clients) refuses a symbolic link:
    a link in the save folder would otherwise let a client read whatever it points at."""
    name = os.fspath(path) if src is None else src
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        mode = os.stat(path, follow_symlinks=follow_symlinks).st_mode
        if stat.S_ISLNK(mode):
            raise StateError(f"{name} is a symbolic link, not a state file; slot files are the files the server saved")
        what = _not_regular(mode)
        if what:
            raise StateError(f"{name} is {what}, not a state file; give the path of a file ubatch saved")
        fd = os.open(path, flags | (0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0)))
    except FileNotFoundError:
        raise StateError(f"cannot read {name} (not found)") from None
    except OSError as e:
        raise StateError(f"cannot read {name} ({e.strerror})") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            st = os.fstat(fd)
            what = _not_regular(st.st_mode)  # replaced since the stat above
            if what:
                raise StateError(f"{name} is {what}, not a state file; give the path of a file ubatch saved")
            size = st.st_size
            first = _read_exact(f, min(size, 8), name)
            n = _header_len(first, size, name)
            _header(_read_exact(f, n, name), size, name)
            f.seek(0)
            data = _read_exact(f, size, name)
        except OSError as e:
            raise StateError(f"cannot read {name} ({e.strerror})") from None
    return from_bytes(data, name), len(data)


def _read_exact(f: io.FileIO, n: int, src: str) -> bytes:
    """Exactly n bytes, in reads of at most READ_CHUNK; a short file is a truncated state."""
    data = f.read(min(n, READ_CHUNK)) or b""
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        chunk = f.read(min(n - got, READ_CHUNK))
        if not chunk:
            raise StateError(f"{src}: the state file is truncated (it shrank while being read); re-create it")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
