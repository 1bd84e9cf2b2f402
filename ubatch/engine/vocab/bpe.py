"""The BPE tokenizer (tokenizer.ggml.model "gpt2", "gemma4", "whitespace") as llama.cpp runs it.

A raw fragment is split into words by the pre-tokeniser; each word is byte-encoded (GPT-2's
byte -> printable character map) unless the vocabulary is raw UTF-8 (Gemma 4), then merged by
llm_tokenizer_bpe_session's loop: repeatedly join the adjacent pair with the lowest merge rank
(leftmost on ties); a final piece that is no token falls back to single-byte tokens. Words repeat
(prose reuses a few thousand), so each word's ids are cached: a long prompt is mostly lookups,
and the words it brings new are merged in C (native.py) where that is built, else here.
"""

from __future__ import annotations

import heapq
import operator
import re
from collections.abc import Callable
from itertools import chain, compress, repeat
from typing import Literal

import numpy as np

from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab import unicode
from ubatch.engine.vocab.native import NativeBpe
from ubatch.engine.vocab.pre_tokenizer import PreTokenizer, Splitter, cut
from ubatch.engine.vocab.tables import BYTE_TEXTS
from ubatch.engine.vocab.token_index import strings

CACHE_WORDS = 1 << 17  # the word cache is dropped when it grows past this many words
_SPACE = "\u2581"
_SHORT_WORD = 48  # symbols: words up to this long merge on lists (_short_word), longer ones on a heap
_NO_MERGE = 1 << 62  # the rank of a pair that no merge joins


def _byte_to_unicode() -> list[str]:
    """GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 on."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BYTE_TO_UNICODE = _byte_to_unicode()
_ENCODE = str.maketrans(dict(enumerate(BYTE_TO_UNICODE)))
UNICODE_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}


def byte_encode(word: str) -> str:
    """The word's UTF-8 bytes, one printable character each."""
    return unicode.utf8(word).decode("latin-1").translate(_ENCODE)


_ENCODE_TABLE = np.array([ord(c) for c in BYTE_TO_UNICODE], "<u2")  # (all below U+0144: one UTF-16 unit)


def byte_encode_all(words: list[str]) -> list[str]:
    """byte_encode of each word, in one pass over all their bytes (numpy) and one split."""
    joined, lengths = unicode.utf8_lengths(words)
    encoded = _ENCODE_TABLE[np.frombuffer(unicode.utf8(joined), np.uint8)].tobytes().decode("utf-16-le")
    return cut(encoded, lengths)


def byte_decode(text: str) -> bytes:
    """llama_decode_text: the bytes a byte-encoded token stands for; a character outside the
    map gives llama.cpp's "[UNK_BYTE_0x..]" marker."""
    out = bytearray()
    for c in text:
        b = UNICODE_TO_BYTE.get(c)
        if b is None:
            u = unicode.utf8(c)
            out += b"[UNK_BYTE_0x" + u.hex().encode() + unicode.utf8(text) + b"]"
        else:
            out.append(b)
    return bytes(out)


class BpeTokenizer:
    """Words -> ids with llama.cpp's rank-ordered merge loop and a cache of words seen."""

    def __init__(
        self, texts: StringArray, merges: StringArray, pre: PreTokenizer, whitespace_model: bool, lowercase: bool
    ) -> None:
        self._texts = texts
        self._ids: dict[str, int] | None = None  # text -> id, built with the ranks on first use
        self._merges = merges
        self._ranks: dict[str, int] | None = None  # built on first use (~0.15 s for 500k merges)
        self._pre = pre
        self._split = Splitter(pre.type)
        self._byte_encode = pre.byte_encode
        self._newline_words = pre.type in ("GEMMA4", "MMBERT")  # a run of newlines that is a token stays one
        self._metaspace = pre.type == "MMBERT"
        self._whitespace_model, self._lowercase = whitespace_model, lowercase
        self._cache: dict[str, list[int]] = {}
        self._space_cuts: re.Pattern[str] | None = None
        self._native: NativeBpe | Literal[False] | None = None  # the C merge loop (built on first use), False: none

    def _build_tables(self) -> tuple[dict[str, int], dict[str, int]]:
        """Token text -> id, and merge line -> rank (a repeated line keeping its first, as
        llama.cpp's bpe_ranks). Dicts, as llama.cpp's hash maps: ~60 bytes an entry, but a
        lookup in C (the merge loop's hot path); built from the strings at C speed (~0.15 s for
        Gemma 4's 262k tokens and 515k merges)."""
        lines = strings(self._merges)
        self._ranks = dict(zip(reversed(lines), range(len(lines) - 1, -1, -1)))
        self._ids = dict(zip(strings(self._texts), range(len(self._texts))))
        return self._ids, self._ranks

    def _find_space_cuts(self) -> re.Pattern[str]:
        """Where a line may be cut before "▁" with the same merges: not after a character that
        ends the left side of a merge whose right side starts with "▁" (Gemma 4 has one: ">"), nor
        inside a run of "▁". Merges never join across such a cut, so the pieces can be merged, and
        cached, apart. Found from the merges' bytes: each " ▁" is a separator, the left side before it."""
        blob = np.frombuffer(self._merges.blob, np.uint8)
        sp = np.flatnonzero((blob[:-3] == 0x20) & (blob[1:-2] == 0xE2) & (blob[2:-1] == 0x96) & (blob[3:] == 0x81))
        off = self._merges.offsets
        lasts = set()
        for p, i in zip(sp.tolist(), (np.searchsorted(off, sp, "right") - 1).tolist()):
            line = self._merges[i]
            sep = line.find(" ", 1)
            if sep == p - int(off[i]) and line[:sep] and not line[:sep].endswith(_SPACE):
                lasts.add(line[sep - 1])
        chars = "".join(re.escape(c) for c in sorted(lasts))
        self._space_cuts = re.compile(f"(?<=[^{_SPACE}{chars}])(?={_SPACE})")
        return self._space_cuts

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(t) for t in texts]

    def _encode(self, text: str) -> list[int]:
        text = unicode.llama_text(text)
        if self._whitespace_model:  # llm_tokenizer_whitespace_session: BPE per whitespace-free segment
            low = [c if not self._lowercase else chr(unicode.lowercase().get(ord(c), ord(c))) for c in text]
            segs = "".join(" " if unicode.flags()[ord(c)] & unicode.WHITESPACE else c for c in low).split()
            return [t for s in segs for t in self._words(s)]
        return self._words(text)

    def _words(self, text: str) -> list[int]:
        words = self._split.words(text)
        if self._metaspace:
            words = _metaspace(words)
        elif self._pre.escape_whitespaces:  # Gemma 4: whole lines; cut them where no merge can reach across
            cut = self._space_cuts or self._find_space_cuts()
            words = [w for line in words for w in cut.split(line)]
        cache = self._cache
        if len(cache) > CACHE_WORDS:
            cache.clear()
        found = list(map(cache.get, words))  # the cache first, in C; then the words it lacks
        if None in found:
            new = list(dict.fromkeys(compress(words, map(operator.is_, found, repeat(None)))))
            cache.update(zip(new, self._new_words(new)))
            found = list(map(cache.get, words))
        return list(chain.from_iterable(found))  # type: ignore[arg-type]  # no None is left

    def _new_words(self, words: list[str], use_native: bool = True) -> list[list[int]]:
        """llm_tokenizer_bpe_session::tokenize for words not in the cache: a word that is a token
        as a whole where llama.cpp takes it so, the rest merged: in C (native.py) where it can
        be, else here."""
        ids, _ = self._tables()
        encoded = byte_encode_all(words) if self._byte_encode else words
        whole: list[int | None]
        if self._pre.ignore_merges:  # a word that is a token is that token
            whole = list(map(ids.get, encoded))
        elif self._newline_words:  # so is a run of newlines
            whole = [None if e.strip("\n") else ids.get(e) for e in encoded]
        else:  # (a one-character word merges to itself)
            whole = [None] * len(encoded)
        rest = list(compress(encoded, map(operator.is_, whole, repeat(None))))
        merged: list[list[int] | None] = [None] * len(rest)
        if use_native and rest:
            if self._native is None:
                self._native = NativeBpe.build(self._texts, self._merges, self._byte_ids(ids)) or False
            if self._native:
                merged = self._native.words(rest)
        if None in merged:
            merged = [m if m is not None else self._merge(e) for e, m in zip(rest, merged)]
        if len(merged) == len(whole):
            return merged  # type: ignore[return-value]  # no None is left
        take = iter(merged).__next__
        return [[t] if t is not None else take() for t in whole]  # type: ignore[misc]  # take() yields lists: every None of whole was merged

    def _byte_ids(self, ids: dict[str, int]) -> list[int]:
        """What _piece gives for each byte of a piece that is no token (-1: nothing)."""
        if self._byte_encode:
            return [ids.get(chr(b), -1) if b < 0x80 else -1 for b in range(256)]
        return [ids.get(t, -1) for t in BYTE_TEXTS]

    def _tables(self) -> tuple[dict[str, int], dict[str, int]]:
        if self._ids is not None and self._ranks is not None:
            return self._ids, self._ranks
        return self._build_tables()

    def _merge(self, word: str) -> list[int]:
        """The merge loop over one (encoded) word that is not taken whole."""
        ids, ranks = self._tables()
        token_id = ids.get
        if len(word) <= _SHORT_WORD:
            return self._short_word(word, ranks.get, token_id)
        sym = list(word)
        n = len(sym)
        rank = ranks.get
        heap = [
            (r, i, i + 1, sym[i] + sym[i + 1]) for i in range(n - 1) if (r := rank(f"{sym[i]} {sym[i + 1]}", -1)) >= 0
        ]
        heapq.heapify(heap)
        nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))
        while heap:
            _, left, right, text = heapq.heappop(heap)
            a, b = sym[left], sym[right]
            if not a or not b or a + b != text:
                continue  # stale: a side was merged since this pair was queued
            sym[left], sym[right] = text, ""
            after = nxt[left] = nxt[right]
            if after < n:
                prv[after] = left
            before = prv[left]
            if before >= 0 and (r := rank(f"{sym[before]} {text}", -1)) >= 0:
                heapq.heappush(heap, (r, before, left, sym[before] + text))
            if after < n and (r := rank(f"{text} {sym[after]}", -1)) >= 0:
                heapq.heappush(heap, (r, left, after, text + sym[after]))
        out: list[int] = []
        i = 0
        while i < n:
            out += self._piece(sym[i], token_id)
            i = nxt[i]
        return out

    def _short_word(
        self, word: str, rank: Callable[[str, int], int], token_id: Callable[[str], int | None]
    ) -> list[int]:
        """The same merges for a short word, on lists: the current pairs' ranks in one list, the
        lowest (the leftmost of equals, as the heap's (rank, left) order) found by min and index
        in C. Each merge costs a scan of the word, cheaper than heap entries below ~64 symbols."""
        sym = list(word)
        rk = [rank(f"{a} {b}", _NO_MERGE) for a, b in zip(sym, sym[1:])]
        while rk:
            r = min(rk)
            if r == _NO_MERGE:
                break
            i = rk.index(r)
            text = sym[i] = sym[i] + sym.pop(i + 1)
            del rk[i]
            if i:
                rk[i - 1] = rank(f"{sym[i - 1]} {text}", _NO_MERGE)
            if i < len(rk):
                rk[i] = rank(f"{text} {sym[i + 1]}", _NO_MERGE)
        ids = list(map(token_id, sym))
        if None not in ids:
            return ids  # type: ignore[return-value]  # no None
        return [t for p in sym for t in self._piece(p, token_id)]

    def _piece(self, piece: str, token_id: Callable[[str], int | None]) -> list[int]:
        tok = token_id(piece)
        if tok is not None:
            return [tok]
        # no such token: its bytes one by one, each only if the vocabulary has it
        raw = unicode.utf8(piece)
        if self._byte_encode:
            found = (token_id(chr(b)) if b < 0x80 else None for b in raw)
        else:
            found = (token_id(BYTE_TEXTS[b]) for b in raw)
        return [t for t in found if t is not None]


def _metaspace(words: list[str]) -> list[str]:
    """llama.cpp's MMBERT step: a word starts with "▁" and every "▁" starts a new word."""
    out: list[str] = []
    for w in words:
        if not w.strip("\n"):
            out.append(w)
            continue
        if not w.startswith(_SPACE):
            w = _SPACE + w
        parts = w.split(_SPACE)[1:]
        out += [_SPACE + p for p in parts]
    return out
