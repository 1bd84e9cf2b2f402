"""Backend-owned weight repacks: the same values in a block type the kernels decode faster.

Q5_0 -> Q8_0 is exact: a Q5_0 value is d * (q - 16) with q in 0..31, and Q8_0 stores d * c with c
an int8, so the repacked block keeps the f16 scale and stores c = q - 16. A block grows from 22
to 34 bytes, but the AVX2 GEMV widens Q8_0 codes straight from memory where Q5_0's need their
fifth bit merged and a sign extension in registers: measured on Zen 3 (2 threads, one row),
attn_q 68.6 -> 51.5 us, and the stored Q5_0 pages are handed back (docs/backends.md).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import torch
from gguf import GGMLQuantizationType as T

from ubatch.kernels.quant.weight import QWeight

Q5_0_BYTES, Q8_0_BYTES = 22, 34
_BIT = torch.arange(8, dtype=torch.uint8)


CHUNK = 2048  # blocks a step: temporaries of 64 KiB, reused from the heap, never a new mapping


def q5_0_to_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks (uint8, a multiple of 22 bytes) as Q8_0 blocks holding the same values."""
    src = raw.view(-1, Q5_0_BYTES)
    out = torch.empty(src.shape[0], Q8_0_BYTES, dtype=torch.uint8)
    for i in range(0, src.shape[0], CHUNK):
        b, o = src[i : i + CHUNK], out[i : i + CHUNK]
        fifth = ((b[:, 2:6].unsqueeze(2) >> _BIT) & 1).view(-1, 32)  # bit j of the LE u32 = value j
        o[:, :2] = b[:, :2]
        torch.bitwise_and(b[:, 6:22], 0xF, out=o[:, 2:18])  # low nibbles are values 0..15, high 16..31
        torch.bitwise_right_shift(b[:, 6:22], 4, out=o[:, 18:])
        o[:, 2:].bitwise_or_(fifth.mul_(16)).sub_(16)  # uint8 wrap-around: the int8 bytes of q - 16
    return out.view(-1)


def _file_mapped(lo: int, hi: int) -> bool:
    """Is [lo, hi) inside one file-backed mapping? Only such pages can be dropped safely: the
    kernel reads them back from the file if touched again, where anonymous memory would be lost."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                a, b = (int(v, 16) for v in parts[0].split("-"))
                if a <= lo and hi <= b:
                    return len(parts) == 6 and parts[5].startswith("/")
    except OSError:
        return False
    return False


def _pages(raw: torch.Tensor) -> tuple[int, int]:
    """The whole pages of a tensor's bytes that can be handed back, [lo, hi); empty if none."""
    if not hasattr(mmap, "MADV_DONTNEED") or os.name != "posix" or raw.device.type != "cpu":
        return 0, 0
    start = raw.data_ptr()
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + raw.numel() * raw.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    return (lo, hi) if hi > lo and _file_mapped(lo, hi) else (0, 0)


def releasable(raw: torch.Tensor) -> int:
    """Bytes `release_pages` would hand back for this tensor."""
    lo, hi = _pages(raw)
    return hi - lo


def release_pages(raw: torch.Tensor) -> int:
    """Hand back the whole pages of a memory-mapped tensor that nothing will read again; the bytes
    released (0 where the tensor is not file-backed or the OS has no madvise). Touched again,
    the pages are read back from the file."""
    lo, hi = _pages(raw)
    if hi <= lo:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return hi - lo if libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED) == 0 else 0


# one repack of a weight however many contexts compute from it (a server's draft, tests): a second
# would read the released pages back in and hold the copy twice; it lives as long as the weight
_SHARED: weakref.WeakKeyDictionary[QWeight, QWeight] = weakref.WeakKeyDictionary()


class Repacks:
    """The weights a backend computes from in another block type, made at first use (a context
    that is only planned repacks nothing) and counted in `held_bytes` net of the file pages they
    let go. Only Q5_0 -> Q8_0, for the AVX2 GEMV, where it was measured faster."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._planned: dict[QWeight, int] = {}  # weight -> file bytes its repack will release
        self._made: dict[QWeight, QWeight] = {}

    def plan(self, weights: list[QWeight]) -> None:
        for w in weights:
            if self.enabled and w.ggml_type == T.Q5_0 and w not in self._planned:
                self._planned[w] = releasable(w.raw)

    def kernel_type(self, w: QWeight) -> int:
        return int(T.Q8_0) if w in self._planned else w.ggml_type

    def layout(self, w: QWeight) -> QWeight:
        """The weight as the kernels read it: its repack (made now, the first time) or itself."""
        if w not in self._planned:
            return w
        p = self._made.get(w)
        if p is None:
            p = _SHARED.get(w)
            if p is None:  # the first context of this weight makes it; later ones share it
                p = _SHARED[w] = QWeight(w.name, q5_0_to_q8_0(w.raw), int(T.Q8_0), w.shape)
                release_pages(w.raw)
            self._made[w] = p
        return p

    def held_bytes(self) -> int:
        return sum(w.nbytes // Q5_0_BYTES * Q8_0_BYTES - freed for w, freed in self._planned.items())

    def extra_bytes(self) -> int:
        """Bytes a pass over every planned weight reads beyond the stored ones (achieved GB/s)."""
        return sum(w.nbytes // Q5_0_BYTES * (Q8_0_BYTES - Q5_0_BYTES) for w in self._planned)

    def describe(self, ggml_type: int) -> str:
        """What the kernel path of a type starts with ("" where nothing is repacked)."""
        if ggml_type != T.Q5_0 or not self._planned:
            return ""
        return "repacked to Q8_0 at first use (the same values; the Q5_0 file pages released), then "
