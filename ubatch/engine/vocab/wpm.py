"""The WordPiece tokenizer (tokenizer.ggml.model "bert") as llama.cpp runs it.

llm_tokenizer_wpm_session: the text is cut into words at whitespace and around punctuation,
ASCII symbols and CJK ideographs (after llama.cpp's lowercasing and accent stripping, with its
one-code-point NFD); each word, prefixed with "▁" as the converted vocabularies spell a word
start, is covered by longest-first matches; a word that cannot be covered is the unknown token.
"""

from __future__ import annotations

import operator
from itertools import chain, compress, repeat
from typing import Literal

import numpy as np

from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab import unicode
from ubatch.engine.vocab.native import NativeWpm
from ubatch.engine.vocab.token_index import strings

_SPACE = "\u2581"
_KEEP, _SPACE_CUT, _DROP, _ALONE = 0, 1, 2, 3  # what preprocessing does with a code point (ub_wpm_text's cls)
_CJK = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B920, 0x2CEAF),  # llama.cpp follows Hugging Face's 0x2B920 here
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


class WpmTokenizer:
    def __init__(self, texts: StringArray, max_token_chars: int, unk: int, lowercase: bool, strip_accents: bool):
        self._texts, self._max, self._unk = texts, max_token_chars, unk
        self._ids: dict[str, int] | None = None  # text -> id, built on first use: the longest-first search probes a lot
        self._lowercase, self._strip = lowercase, strip_accents
        self._cache: dict[str, list[int]] = {}
        self._native: NativeWpm | Literal[False] | None = None  # the C loop (built on first use), False: none
        self._tables: tuple[np.ndarray, np.ndarray] | None = None  # _char_tables

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(t) for t in texts]

    def _encode(self, text: str) -> list[int]:
        if self._native is None:
            self._native = NativeWpm.build(self._texts) or False
        if self._native:  # all of it in C: no word is a Python object
            cls, to = self._char_tables()
            cps = unicode.codepoints(unicode.llama_text(text))
            return self._native.text(cps, cls, to, self._max, self._unk)
        cache = self._cache
        if len(cache) > 1 << 17:
            cache.clear()
        words = self.words(text)
        found = list(map(cache.get, words))  # the cache first, in C; then the words it lacks
        if None in found:
            new = list(dict.fromkeys(compress(words, map(operator.is_, found, repeat(None)))))
            cache.update(zip(new, self._new_words(new)))
            found = list(map(cache.get, words))
        return list(chain.from_iterable(found))  # type: ignore[arg-type]  # no None is left

    def _new_words(self, words: list[str]) -> list[list[int]]:
        """Each word's cover: in C (native.py) where it is built, else _word."""
        if self._native:
            return self._native.words([_SPACE + w for w in words], self._max, self._unk)
        return list(map(self._word, words))

    def _char_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Per code point, what preprocessing does with it (_KEEP, _SPACE_CUT, _DROP, _ALONE) and the
        code point it becomes (the first of its NFD when accents are stripped, lowercased): whitespace
        separates, control characters (and accents when stripped) vanish, punctuation, ASCII symbols
        and CJK ideographs stand alone. Built once (~5 MB)."""
        if self._tables is None:
            cps = np.arange(unicode.MAX_CODEPOINTS, dtype=np.uint32)
            if self._strip:
                cps = unicode.nfd()[cps]
            f = unicode.flags()[cps]
            space = (f & unicode.WHITESPACE) != 0
            drop = (cps == 0) | (cps == 0xFFFD) | ((f & unicode.CONTROL) != 0)
            if self._strip:
                drop |= (f & unicode.ACCENT_MARK) != 0
            drop &= ~space
            alone = ((f & unicode.PUNCTUATION) != 0) | ((cps < 0x7F) & ((f & unicode.SYMBOL) != 0)) | _is_cjk(cps)
            alone &= ~space & ~drop
            cls = np.full(len(cps), _KEEP, np.uint8)
            cls[space], cls[drop], cls[alone] = _SPACE_CUT, _DROP, _ALONE
            self._tables = cls, unicode.lower_table()[cps] if self._lowercase else cps
        return self._tables

    def words(self, text: str) -> list[str]:
        """llm_tokenizer_wpm_session::preprocess, vectorised (_char_tables): one split at the
        spaces put in place of whitespace and around the characters that stand alone."""
        cps = unicode.codepoints(unicode.llama_text(text))
        if not len(cps):
            return []
        cls, to = self._char_tables()
        k = cls[cps]
        out = np.zeros((len(cps), 3), np.uint32)  # [space before, character, space after]; 0 = nothing
        out[:, 1] = to[cps]
        out[k == _SPACE_CUT, 1] = 0x20
        out[k == _DROP, 1] = 0
        out[k == _ALONE, 0] = out[k == _ALONE, 2] = 0x20
        flat = out.ravel()
        joined = flat[flat != 0].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")
        return [w for w in joined.split(" ") if w]

    def _word(self, word: str) -> list[int]:
        """Longest-first cover of "▁" + word; the unknown token if some position has no match."""
        w = _SPACE + word
        if self._ids is None:
            self._ids = dict(zip(strings(self._texts), range(len(self._texts))))
        n, i, out, get = len(w), 0, [], self._ids.get
        while i < n:
            for j in range(min(n, i + self._max), i, -1):
                tok = get(w[i:j])
                if tok is not None:
                    out.append(tok)
                    i = j
                    break
            else:
                return [self._unk]
        return out


def _is_cjk(cps: np.ndarray) -> np.ndarray:
    out = np.zeros(len(cps), bool)
    for a, b in _CJK:
        out |= (cps >= a) & (cps <= b)
    return out


def max_chars(lengths: np.ndarray) -> int:
    """An upper bound on a token's length in characters: its length in bytes."""
    return int(lengths.max()) if len(lengths) else 0
