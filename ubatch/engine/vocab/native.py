"""The per-word loops of BPE, WordPiece and Unigram in C (csrc/words.c), for the words a text
brings that the word caches do not hold yet.

The Python loops of bpe.py, wpm.py and ugm.py are llama.cpp's algorithms; this C file runs the
same steps ~20-50x faster (a long prompt's new words, not its repeated ones, are what tokenising
costs). It is compiled once per (source, compiler) into the user cache directory
(`$XDG_CACHE_HOME/ubatch/vocab`, default ~/.cache), as the CPU kernels are, and loaded with
ctypes; without a C compiler (or if the build fails) `library()` is None and the Python loops
run, with the same ids. A vocabulary the C loop cannot provably run as llama.cpp does (BPE merges
that join texts that are no tokens) gets None from its constructor here, and the Python loop too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab import unicode

SOURCE = Path(__file__).with_name("csrc") / "words.c"
ABI = 1
_FLAGS = ["-O2", "-shared", "-fPIC", "-std=c11"]
_TOO_SMALL = -(1 << 40)
CACHE_WORDS = 1 << 17  # a word cache in C is emptied when it holds this many words


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ubatch" / "vocab"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled words.c (built on first use), or None: no compiler, or it failed."""
    if os.environ.get("UBATCH_VOCAB_NATIVE", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if cc is None:
        return None
    try:
        src = SOURCE.read_bytes()
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(
            b"\0".join([src, version.encode(), " ".join(_FLAGS).encode(), platform.machine().encode()])
        )
        out = _cache_dir() / f"vocab_words-{key.hexdigest()[:16]}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".build-{os.getpid()}-") as d:
                tmp = Path(d) / out.name
                r = subprocess.run([cc, *_FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, timeout=120)
                if r.returncode != 0:
                    return None
                tmp.replace(out)  # atomic: a concurrent first start never loads a half-written library
        lib = ctypes.PyDLL(str(out))  # calls hold the GIL: a vocabulary's word cache has one user at a time
    except (OSError, subprocess.SubprocessError):
        return None
    if lib.ub_words_abi() != ABI:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.ub_bpe_new.argtypes = [p, p, i64, p, p, i64, p]
    lib.ub_bpe_new.restype = p
    lib.ub_bpe_free.argtypes = [p]
    lib.ub_bpe_words.argtypes = [p, p, p, i64, p, i64, p]
    lib.ub_bpe_words.restype = i64
    lib.ub_wpm_new.argtypes = [p, p, i64]
    lib.ub_wpm_new.restype = p
    lib.ub_tab_free.argtypes = [p]
    lib.ub_wpm_words.argtypes = [p, p, p, i64, i64, i32, p, i64, p]
    lib.ub_wpm_words.restype = i64
    lib.ub_wpm_text.argtypes = [p, p, i64, p, p, i64, i32, p, i64]
    lib.ub_wpm_text.restype = i64
    lib.ub_ugm_new.argtypes = [p, p, i64, p, p, i32, ctypes.c_double]
    lib.ub_ugm_new.restype = p
    lib.ub_ugm_free.argtypes = [p]
    lib.ub_ugm_words.argtypes = [p, p, p, i64, p, i64, p]
    lib.ub_ugm_words.restype = i64
    lib.ub_cache_new.argtypes = [i64]
    lib.ub_cache_new.restype = p
    lib.ub_cache_free.argtypes = [p]
    lib.ub_ugm_text.argtypes = [p, p, p, i64, p, i64]
    lib.ub_ugm_text.restype = i64
    return lib


def _ptr(a: np.ndarray | bytes) -> int:
    if isinstance(a, bytes):
        return ctypes.cast(ctypes.c_char_p(a), ctypes.c_void_p).value or 0
    return a.ctypes.data


def _batch(words: list[str]) -> tuple[bytes, np.ndarray]:
    """The words' UTF-8 (as llama.cpp writes code points: surrogates too) in one buffer, and offsets."""
    joined, lengths = unicode.utf8_lengths(words)
    off = np.zeros(len(words) + 1, np.int64)
    np.cumsum(lengths, out=off[1:])
    return unicode.utf8(joined), off


def _batch_bytes(encoded: list[bytes]) -> tuple[bytes, np.ndarray]:
    off = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=off[1:])
    return b"".join(encoded), off


def _groups(ids: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    flat = ids.tolist()
    ends = np.cumsum(counts).tolist()
    return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]


class _Native:
    """A table built in C over the vocabulary's texts (kept alive here), freed with this object."""

    _free: str

    def __init__(self, lib: ctypes.CDLL, handle: int | None, *keep: object) -> None:
        self._lib, self._h, self._keep = lib, handle, keep

    def __del__(self) -> None:
        if self._h:
            getattr(self._lib, self._free)(self._h)
            self._h = None


def _texts(texts: StringArray) -> tuple[bytes, np.ndarray]:
    return texts.blob, np.ascontiguousarray(texts.offsets, np.int64)


class NativeBpe(_Native):
    """llm_tokenizer_bpe_session's merge loop for words not taken whole."""

    _free = "ub_bpe_free"

    @classmethod
    def build(cls, texts: StringArray, merges: StringArray, byte_ids: list[int]) -> NativeBpe | None:
        """None without the library, or when a merge joins texts that are not both tokens into a
        token (llama.cpp's loop then merges symbols by text; only the Python loop does that)."""
        lib = library()
        if lib is None:
            return None
        blob, off = _texts(texts)
        mblob, moff = _texts(merges)
        table = np.asarray(byte_ids, np.int32)
        h = lib.ub_bpe_new(_ptr(blob), _ptr(off), len(texts), _ptr(mblob), _ptr(moff), len(merges), _ptr(table))
        return cls(lib, h, blob, off) if h else None

    def words(self, words: list[str]) -> list[list[int] | None]:
        """Each word's ids; None for a word too long for the C loop (the caller merges it)."""
        text, off = _batch(words)
        ids = np.empty(len(text) + 1, np.int32)
        counts = np.zeros(len(words), np.int32)
        out: list[list[int] | None] = []
        at = 0
        while at < len(words):
            n = self._lib.ub_bpe_words(
                self._h, _ptr(text), _ptr(off[at:]), len(words) - at, _ptr(ids), len(ids), _ptr(counts)
            )
            assert n != _TOO_SMALL  # each byte gives at most one id
            done = len(words) - at if n >= 0 else -1 - n
            out += _groups(ids[: int(counts[:done].sum())], counts[:done])
            at += done
            if n < 0:
                out.append(None)
                at += 1
        return out


class NativeWpm(_Native):
    """llm_tokenizer_wpm_session's longest-first cover of each word."""

    _free = "ub_tab_free"

    @classmethod
    def build(cls, texts: StringArray) -> NativeWpm | None:
        lib = library()
        if lib is None:
            return None
        blob, off = _texts(texts)
        h = lib.ub_wpm_new(_ptr(blob), _ptr(off), len(texts))
        return cls(lib, h, blob, off) if h else None

    def words(self, words: list[str], max_len: int, unk: int) -> list[list[int]]:
        """Each word's ids (words start with the word-start mark already)."""
        text, off = _batch(words)
        ids = np.empty(len(text) + len(words), np.int32)
        counts = np.zeros(len(words), np.int32)
        n = self._lib.ub_wpm_words(
            self._h, _ptr(text), _ptr(off), len(words), max_len, unk, _ptr(ids), len(ids), _ptr(counts)
        )
        assert n >= 0  # at most one id per byte, or the unknown one per word
        return _groups(ids[:n], counts)

    def text(self, cps: np.ndarray, cls: np.ndarray, to: np.ndarray, max_len: int, unk: int) -> list[int]:
        """All of a text's ids, preprocessing included: code points, and per code point what
        preprocessing does with it (cls) and the one it becomes (to); see ub_wpm_text."""
        cps = np.ascontiguousarray(cps, np.uint32)
        ids = np.empty(2 * len(cps) + 16, np.int32)  # a word of k characters: at most k + 1 ids
        n = self._lib.ub_wpm_text(self._h, _ptr(cps), len(cps), _ptr(cls), _ptr(to), max_len, unk, _ptr(ids), len(ids))
        assert n >= 0
        return ids[:n].tolist()


class NativeUgm(_Native):
    """llm_tokenizer_ugm_session's Viterbi pass over each word (normalised bytes)."""

    _free = "ub_ugm_free"

    @classmethod
    def build(
        cls, texts: StringArray, keep: np.ndarray, scores: list[float], unk: int, unknown_score: float
    ) -> NativeUgm | None:
        """The trie of the tokens with `keep`; scores per token id (the file's float32 values,
        user-defined ones 0)."""
        lib = library()
        if lib is None:
            return None
        blob, off = _texts(texts)
        k = np.ascontiguousarray(keep, np.uint8)
        sc = np.asarray(scores, np.float32)  # (float32 values: exact)
        h = lib.ub_ugm_new(_ptr(blob), _ptr(off), len(texts), _ptr(k), _ptr(sc), unk, unknown_score)
        if not h:
            return None
        out = cls(lib, h)
        out._cache = lib.ub_cache_new(CACHE_WORDS)
        return out if out._cache else None

    _cache: int | None = None

    def __del__(self) -> None:
        if self._cache:
            self._lib.ub_cache_free(self._cache)
            self._cache = None
        super().__del__()

    def text(self, s: bytes) -> list[int]:
        """The ids of a normalised text in which no token reaches across a U+2581: word by word
        (the text before each U+2581), each from the cache of words or a Viterbi pass."""
        ids = np.empty(len(s) + 1, np.int32)
        n = self._lib.ub_ugm_text(self._h, self._cache, _ptr(s), len(s), _ptr(ids), len(ids))
        assert n >= 0  # at most one id per byte
        return ids[:n].tolist()

    def words(self, words: list[bytes]) -> list[list[int]]:
        text, off = _batch_bytes(words)
        ids = np.empty(len(text) + 1, np.int32)
        counts = np.zeros(len(words), np.int32)
        n = self._lib.ub_ugm_words(self._h, _ptr(text), _ptr(off), len(words), _ptr(ids), len(ids), _ptr(counts))
        assert n >= 0  # at most one id per byte
        return _groups(ids[:n], counts)
