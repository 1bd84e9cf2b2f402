"""The SPM tokenizer (tokenizer.ggml.model "llama") exactly as llama.cpp's llama-vocab.cpp runs it.

llama.cpp's score-driven merge loop on each raw fragment. Texts of SP_MIN_CHARS or more run the
loop in `sentencepiece`, from a BPE ModelProto built out of the GGUF vocabulary the first time
one comes (reference/gguf-models.md §4.6): it is ~10x faster than the pure-Python loop
(spm_merge.py), but its 262,144 pieces cost ~40 MiB that a short prompt does not need. Shorter
texts, and vocabularies sentencepiece cannot express (no byte tokens, no unknown token), take the
Python loop.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab.spm_merge import spm_merge
from ubatch.engine.vocab.spm_model import sentencepiece_for
from ubatch.engine.vocab.tables import BYTE_TEXTS
from ubatch.engine.vocab.token_index import TokenIndex

if TYPE_CHECKING:
    from sentencepiece import SentencePieceProcessor

SP_MIN_CHARS = 256  # a call whose raw fragments hold this many characters takes sentencepiece


class _Unbuilt(enum.Enum):
    UNBUILT = "unbuilt"


_UNBUILT = _Unbuilt.UNBUILT  # the sentencepiece processor before its first use


class SpmTokenizer:
    """Raw fragments (spaces not yet escaped) -> ids."""

    def __init__(
        self, texts: StringArray, token_id: TokenIndex, scores: np.ndarray, unk: int, sp_min_chars: int | None
    ) -> None:
        self._text, self._id, self._scores, self.unk = texts, token_id, scores, unk
        self._suspects: list[str] = []
        self.sp_min_chars = sp_min_chars  # None: never sentencepiece
        self._processor: SentencePieceProcessor | None | _Unbuilt = _UNBUILT

    @property
    def _sp(self) -> SentencePieceProcessor | None:
        """The sentencepiece processor, built on first use (~40 MiB for 262,144 pieces)."""
        sp = self._processor
        if isinstance(sp, _Unbuilt):
            sp = self._processor = None if self.sp_min_chars is None else self._build_sentencepiece()
        return sp

    def _build_sentencepiece(self) -> SentencePieceProcessor | None:
        """A BPE ModelProto whose merge loop is llama.cpp's; None if the vocab cannot be one."""
        byte_ids = [i for t in BYTE_TEXTS if (i := self._id.get(t)) is not None]
        if len(byte_ids) < len(BYTE_TEXTS) or self._text[self.unk] in BYTE_TEXTS:
            return None
        # All other pieces are NORMAL so merges reach control/user-defined tokens as in llama.cpp
        # (we split special texts out ourselves). SentencePiece never merges into byte/unknown
        # pieces, llama.cpp could: fragments holding such a buildable text take the Python loop.
        reserved = {self.unk, *byte_ids}
        self._suspects = [self._text[i] for i in reserved if self._buildable(self._text[i])]
        return sentencepiece_for(self._text, self._scores, self.unk, byte_ids)

    def _buildable(self, text: str) -> bool:
        """Could the merge loop build `text`? Its last merge joins two tokens or single chars."""
        ok = lambda s: len(s) == 1 or s in self._id  # noqa: E731
        return any(ok(text[:k]) and ok(text[k:]) for k in range(1, len(text)))

    def encode(self, texts: list[str]) -> list[list[int]]:
        # short texts take the Python loop: sentencepiece is only built for a text that needs its speed
        if self.sp_min_chars is None or sum(map(len, texts)) < self.sp_min_chars or self._sp is None:
            return [self._merge(t) for t in texts]
        if any(not t.isascii() and not _is_utf8(t) for t in texts) or (
            self._suspects and any(s in t for s in self._suspects for t in texts)
        ):  # bytes that are not UTF-8, or a buildable byte/unknown text: those fragments take the loop
            slow = lambda t: not _is_utf8(t) or any(s in t for s in self._suspects)  # noqa: E731
            return [self._merge(t) if slow(t) else self._sp.encode(t) for t in texts]
        return self._sp.encode(texts)

    def _merge(self, text: str) -> list[int]:
        """llama.cpp's SPM merge loop on one raw fragment, in pure Python (the fallback)."""
        return spm_merge(text, self._id.get, self._scores, self._byte)

    def _byte(self, b: int) -> int:
        tok = self._id.get(BYTE_TEXTS[b], self._id.get(chr(b)) if b < 0x80 else None)
        return self.unk if tok is None else tok  # where llama.cpp would throw


def _is_utf8(text: str) -> bool:
    """No surrogate escapes (bytes that are not UTF-8) in `text`."""
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False
