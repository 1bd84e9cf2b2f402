"""A GGUF string array (a vocabulary's 262,144 token texts) as one UTF-8 blob plus offsets.

As Python strings the Gemma 3 vocabulary costs ~22 MiB of small objects (a list and a str per
token) that the allocator never gives back; as one `bytes` blob and an offsets array it is
~4 MiB, built in one pass over the file's bytes. Element i is decoded only when asked for.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Iterator

import numpy as np

_ERRORS = "surrogatepass"  # a list of str given to from_strings round-trips, lone surrogates too


class StringArray:
    """An immutable sequence of str stored as UTF-8 `blob` with `offsets` (n + 1 byte offsets)."""

    __slots__ = ("blob", "offsets", "off")

    def __init__(self, blob: bytes, offsets: np.ndarray) -> None:
        self.blob = blob
        wide = len(offsets) and int(offsets[-1]) >= 1 << 31
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64 if wide else np.int32)
        self.off = self.offsets.data.cast("B").cast("q" if wide else "i")  # fast reads as Python ints

    @classmethod
    def from_strings(cls, items: Iterable[str]) -> StringArray:
        encoded = [s.encode("utf-8", _ERRORS) for s in items]
        offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        return cls(b"".join(encoded), offsets)

    @classmethod
    def parse(cls, buf: memoryview, pos: int, count: int) -> tuple[StringArray, int]:
        """`count` GGUF strings (u64 length + bytes each) at buf[pos:]; (array, position after).
        EOFError if they run past the end. Invalid UTF-8 is replaced, as for a single string."""
        starts, unpack, size = array("q"), struct.Struct("<Q").unpack_from, len(buf)
        for _ in range(count):
            if pos + 8 > size:
                raise EOFError
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > size:
                raise EOFError
            starts.append(pos)
            pos += n
        if not count:
            return cls(b"", np.zeros(1, np.int64)), pos
        st = np.frombuffer(starts, np.int64)
        lens = np.append(st[1:] - 8, pos) - st
        offsets = np.zeros(count + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        # the stored bytes minus the 8-byte length before each string, gathered in one copy
        first = int(st[0])
        region = np.frombuffer(buf, np.uint8, count=pos - first, offset=first)
        keep = np.ones(len(region), bool)
        for k in range(1, 9):
            keep[st[1:] - (first + k)] = False
        blob = region[keep].tobytes()
        out = cls(blob, offsets)
        if not out._valid_utf8(lens):
            out = cls.from_strings(blob[a:b].decode("utf-8", errors="replace") for a, b in out.spans())
        return out, pos

    def _valid_utf8(self, lens: np.ndarray) -> bool:
        """Every element valid UTF-8: the blob decodes and no element starts mid-character."""
        try:
            self.blob.decode("utf-8")
        except UnicodeDecodeError:
            return False
        first = (
            np.frombuffer(self.blob, np.uint8)[self.offsets[:-1][lens > 0]] if len(self.blob) else np.zeros(0, np.uint8)
        )
        return not bool(np.any((first & 0xC0) == 0x80))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def piece(self, i: int) -> bytes:
        """Element i's UTF-8 bytes (negative i counts from the end, as a list's index)."""
        if i < 0:
            i += len(self.off) - 1
        return self.blob[self.off[i] : self.off[i + 1]]

    def __getitem__(self, i: int) -> str:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.blob[self.off[i] : self.off[i + 1]].decode("utf-8", _ERRORS)

    def __iter__(self) -> Iterator[str]:
        blob, off = self.blob, self.off
        return (blob[off[i] : off[i + 1]].decode("utf-8", _ERRORS) for i in range(len(self)))

    def spans(self) -> Iterator[tuple[int, int]]:
        off = self.off
        return ((off[i], off[i + 1]) for i in range(len(self)))

    def lengths(self) -> np.ndarray:
        """Each element's length in bytes."""
        return np.diff(self.offsets)

    def __repr__(self) -> str:
        return f"<array of {len(self)} strings>"
