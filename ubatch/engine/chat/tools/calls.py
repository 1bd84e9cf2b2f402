"""What every format's parser shares: a call as read (JSON arguments as text), the two ways a
reading fails, and the small scans over text that may still be growing."""

from __future__ import annotations

from dataclasses import dataclass


class Malformed(Exception):
    """The calls are not in the format: the text is content."""


class CutShort(Exception):
    """A whole text that ends inside a call: read it as a partial one."""


@dataclass(slots=True)
class RawCall:
    name: str
    args: str  # JSON text as written (so far, when partial)
    id: str | None = None


def cut_partial_marker(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a tail that may still grow into one of `markers` (held back)."""
    cut = len(text)
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                cut = min(cut, len(text) - n)
                break
    return text[:cut]


def expect(text: str, pos: int, word: str) -> int | None:
    """Position after `word` at `pos`; -1 when the text ends inside it; None if something else."""
    tail = text[pos : pos + len(word)]
    if tail == word:
        return pos + len(word)
    if len(tail) < len(word) and word.startswith(tail):
        return -1
    return None
