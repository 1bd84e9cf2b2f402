"""The WordPiece tokenizer (tokenizer.ggml.model "bert") as llama.cpp runs it.

llm_tokenizer_wpm_session: the text is cut into words at whitespace and around punctuation,
ASCII symbols and CJK ideographs (after llama.cpp's lowercasing and accent stripping, with its
one-code-point NFD); each word, prefixed with "▁" as the converted vocabularies spell a word
start, is covered by longest-first matches; a word that cannot be covered is the unknown token.
"""

from __future__ import annotations

import numpy as np

from ubatch.engine.vocab import unicode
from ubatch.engine.vocab.token_index import TokenIndex

_SPACE = "\u2581"
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
    def __init__(self, token_id: TokenIndex, max_token_chars: int, unk: int, lowercase: bool, strip_accents: bool):
        self._id, self._max, self._unk = token_id, max_token_chars, unk
        self._lowercase, self._strip = lowercase, strip_accents
        self._cache: dict[str, list[int]] = {}

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(t) for t in texts]

    def _encode(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        if len(cache) > 1 << 17:
            cache.clear()
        for w in self.words(text):
            ids = cache.get(w)
            if ids is None:
                ids = cache[w] = self._word(w)
            out += ids
        return out

    def words(self, text: str) -> list[str]:
        """llm_tokenizer_wpm_session::preprocess."""
        cps = unicode.codepoints(unicode.llama_text(text))
        if self._strip:
            cps = unicode.nfd()[cps]
        flags = unicode.flags()[cps]
        lower = unicode.lowercase()
        words: list[str] = []
        cur: list[str] = []
        for cp, f in zip(cps.tolist(), flags.tolist()):
            if f & unicode.WHITESPACE:
                if cur:
                    words.append("".join(cur))
                    cur = []
                continue
            if cp in (0, 0xFFFD) or f & unicode.CONTROL or (self._strip and f & unicode.ACCENT_MARK):
                continue
            s = chr(lower.get(cp, cp) if self._lowercase else cp)
            if f & unicode.PUNCTUATION or (cp < 0x7F and f & unicode.SYMBOL) or _is_cjk(cp):
                if cur:
                    words.append("".join(cur))
                words.append(s)
                cur = []
            else:
                cur.append(s)
        if cur:
            words.append("".join(cur))
        return words

    def _word(self, word: str) -> list[int]:
        """Longest-first cover of "▁" + word; the unknown token if some position has no match."""
        w = _SPACE + word
        n, i, out, get = len(w), 0, [], self._id.get
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


def _is_cjk(cp: int) -> bool:
    return any(a <= cp <= b for a, b in _CJK)


def max_chars(lengths: np.ndarray) -> int:
    """An upper bound on a token's length in characters: its length in bytes."""
    return int(lengths.max()) if len(lengths) else 0
