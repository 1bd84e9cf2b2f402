"""A sequence's saved state as bytes: a safetensors file with a small string header.

The tensors are the cells of one sequence (per KV cache: positions, pending shifts, then the K
and V rows of every layer in the cache type) plus its token ids; the header names the model
(`fingerprint`), the cache types and sizes and the format version. Reading checks that the file
is a whole, well-formed state; whether it fits a given context is `engine/context/state.py`'s job.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ubatch.engine.errors import ContextError
from ubatch.engine.model.model import Model

FORMAT = "ubatch-seq-state"
VERSION = 1


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


def fingerprint(model: Model) -> str:
    """A hash of what makes two models the same for a KV cache: the metadata (long arrays by
    length and ends), the tensor table, and the first bytes of every tensor (so a fine-tune with
    the same shapes differs)."""
    h = hashlib.sha256()
    g = model.gguf
    for k in sorted(g.metadata):
        v = g.metadata[k]
        shown = (len(v), list(v[:8]), list(v[-8:])) if isinstance(v, (list, tuple)) and len(v) > 16 else v
        h.update(f"{k}={shown!r}\n".encode())
    for name, t in sorted(g.tensors.items()):
        h.update(f"{name}:{t.ggml_type}:{tuple(t.shape)}\n".encode())
        if isinstance(t.data, np.ndarray):
            h.update(t.data.reshape(-1)[:64].tobytes())
    h.update(repr(model.hparams).encode())
    return h.hexdigest()[:32]


def to_bytes(state: SeqState) -> bytes:
    from safetensors.torch import save

    tensors = {k: v.contiguous() for k, v in state.tensors.items()}
    tensors["tokens"] = torch.tensor(state.tokens, dtype=torch.int32)
    meta = dict(state.header, format=FORMAT, version=str(VERSION))
    return save(tensors, metadata=meta)


def from_bytes(data: bytes, src: str = "state") -> SeqState:
    """Parse a state; anything that is not a whole state of this format is one StateError."""
    from safetensors.torch import load

    meta = _header(data, src)
    try:
        tensors = load(data)
    except Exception as e:  # safetensors raises its own error types for damaged payloads
        raise StateError(f"{src}: not a readable state file ({e})".splitlines()[0]) from None
    tok = tensors.pop("tokens", None)
    if tok is None or tok.dim() != 1:
        raise StateError(f"{src}: the state file has no token list")
    return SeqState(meta, [int(t) for t in tok.tolist()], tensors)


def _header(data: bytes, src: str) -> dict[str, str]:
    """The safetensors JSON header's metadata, checked before the tensors are touched."""
    if len(data) < 8:
        raise StateError(f"{src}: not a state file (too short: {len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise StateError(f"{src}: not a state file, or truncated (header of {n} bytes, file of {len(data)})")
    try:
        head = json.loads(data[8 : 8 + n])
    except ValueError:
        raise StateError(f"{src}: not a state file (its header is not JSON)") from None
    meta = head.get("__metadata__") if isinstance(head, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateError(f"{src}: not a ubatch state file")
    if meta.get("version") != str(VERSION):
        raise StateError(
            f"{src}: state format version {meta.get('version')} is not supported (this build reads {VERSION})"
        )
    try:
        end = max((int(t["data_offsets"][1]) for k, t in head.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise StateError(f"{src}: not a state file (its tensor table is malformed)") from None
    if 8 + n + end > len(data):
        raise StateError(f"{src}: the state file is truncated ({len(data)} bytes, {8 + n + end} expected)")
    return {str(k): str(v) for k, v in meta.items()}


def write_file(path: str | os.PathLike[str], state: SeqState) -> int:
    """Write atomically (a temporary file renamed over the target); returns the bytes written."""
    data = to_bytes(state)
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        raise StateError(f"cannot write state file {os.fspath(path)}: {e.strerror}") from None
    return len(data)


def read_file(path: str | os.PathLike[str]) -> tuple[SeqState, int]:
    """The state in a file and its size in bytes."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise StateError(f"state file not found: {os.fspath(path)}") from None
    except OSError as e:
        raise StateError(f"cannot read state file {os.fspath(path)}: {e.strerror}") from None
    return from_bytes(data, os.fspath(path)), len(data)
