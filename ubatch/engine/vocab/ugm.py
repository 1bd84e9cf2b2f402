"""The Unigram tokenizer (tokenizer.ggml.model "t5") as llama.cpp runs it (llm_tokenizer_ugm).

The text is normalised first, on its UTF-8 bytes: a user-defined token's prefix stays as it is,
else the longest match in SentencePiece's precompiled charsmap (a XOR-compressed double array,
"XCDA", and NUL-terminated replacements) replaces it, else the character stays (a byte that is
not UTF-8 becomes U+FFFD); spaces become "▁", one is put before the text, and runs of them may
be merged. Then a Viterbi pass picks the tokenisation with the best summed score (user-defined
tokens score 0; a character no token covers costs the lowest score less 10, as unknown), and
consecutive unknowns become one. Pure Python, made fast by remembering: a character's
normalisation where it alone decided it, and each word's Viterbi path (the pass runs word by word
where no token reaches across a "▁").
"""

from __future__ import annotations

import bisect
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Literal

import numpy as np

from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab.native import NativeUgm
from ubatch.engine.vocab.tables import A_NORMAL, A_UNUSED, A_USER_DEFINED

_SPACE = "\u2581".encode()
_SHORT = 6  # token prefixes up to this many bytes are kept in a set (~7 MB for 250k tokens)
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)  # by high nibble, as unicode_len_utf8
# what decides a character's normalisation (_char_flags): _KNOWN alone, it is itself; _CHANGES:
# the charsmap replaces it alone; _WIDE_NEXT: a key may go on, but only with a non-ASCII character
# after it (which ones: _wide_next); _ALWAYS: a key may go on with an ASCII one, or a user-defined
# token starts with its first byte
_KNOWN, _CHANGES, _WIDE_NEXT, _ALWAYS = 1, 2, 4, 8


@dataclass(frozen=True)
class UgmOptions:
    add_space_prefix: bool
    remove_extra_whitespaces: bool
    escape_whitespaces: bool = True
    treat_whitespace_as_suffix: bool = False


class Charsmap:
    """SentencePiece's precompiled normaliser: longest-prefix replacements over bytes."""

    def __init__(self, blob: bytes) -> None:
        size = int.from_bytes(blob[:4], "little")
        if size + 4 >= len(blob):
            raise ValueError("precompiled charsmap: index out of bounds")
        self.xcda = np.frombuffer(blob[4 : 4 + size], "<u4").tolist()
        self._xcda = np.frombuffer(blob[4 : 4 + size], "<u4").astype(np.int64)
        self.replacements = blob[4 + size :]

    def walk_chars(self, cps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """match_reading at each code point alone, all at once (numpy): the longest key's length
        in bytes (0: none) and its replacement's offset, and for each byte value whether a key
        goes on with it after the whole character."""
        x, n = self._xcda, len(self._xcda)
        mask = (1 << 31) | 0xFF

        def base(v: np.ndarray) -> np.ndarray:
            return (v >> 10) << ((v & (1 << 9)) >> 6)

        table, length = utf8_bytes(cps)
        node = np.full(len(cps), int(base(x[:1])[0]), np.int64)
        alive = np.ones(len(cps), bool)
        best_len, best_at = np.zeros(len(cps), np.int64), np.zeros(len(cps), np.int64)
        for k in range(4):
            c = table[:, k]
            step = alive & (k < length)
            alive &= ~(step & (c == 0))
            step &= c != 0
            nd = node ^ c
            ok = step & (nd < n)
            lab = np.where(ok, x[np.where(ok, nd, 0)], 0)
            ok &= (lab & mask) == c
            nd2 = nd ^ base(lab)
            ok2 = ok & (nd2 < n)
            alive &= ~(step & ~ok2)
            hit = ok2 & ((lab >> 8) & 1 == 1)
            best_len = np.where(hit, k + 1, best_len)
            best_at = np.where(hit, x[np.where(ok2, nd2, 0)] & ((1 << 31) - 1), best_at)
            node = np.where(ok2, nd2, node)
        d = np.arange(256, dtype=np.int64)
        child = node[alive, None] ^ d
        inside = child < n
        goes_on = np.zeros((len(cps), 256), bool)
        goes_on[alive] = inside & ((x[np.where(inside, child, 0)] & mask) == d) & (d != 0)
        return best_len, best_at, goes_on

    def replacement(self, at: int) -> bytes:
        end = self.replacements.find(b"\0", at)
        if at >= len(self.replacements) or end < 0:
            raise ValueError("precompiled charsmap: unterminated replacement")
        return self.replacements[at:end]

    def keeps_in_ascii(self, c: int) -> bool:
        """Is ASCII byte c, followed by an ASCII byte, never the start of a key? (No key is c
        itself, and none goes on from c with an ASCII byte.)"""
        xcda, n = self.xcda, len(self.xcda)

        def base(i: int) -> int:
            return (xcda[i] >> 10) << ((xcda[i] & (1 << 9)) >> 6)

        node = base(0) ^ c
        if node >= n or xcda[node] & ((1 << 31) | 0xFF) != c:
            return True  # no key starts with c
        if (xcda[node] >> 8) & 1:
            return False  # c alone is a key
        after = node ^ base(node)
        return not any((k := after ^ d) < n and xcda[k] & ((1 << 31) | 0xFF) == d for d in range(1, 0x80))

    def match(self, s: bytes, at: int) -> tuple[bytes, int] | None:
        """(replacement, bytes consumed) of the longest charsmap key at s[at:], or None."""
        return self.match_reading(s, at)[0]

    def match_reading(self, s: bytes, at: int) -> tuple[tuple[bytes, int] | None, int]:
        """match's answer, and the end of the bytes it depended on (len(s) + 1 if it read to the
        end: the text's end, too, decided it)."""
        xcda, n = self.xcda, len(self.xcda)

        def base(i: int) -> int:
            v = xcda[i]
            return (v >> 10) << ((v & (1 << 9)) >> 6)

        node, best_len, best_at, read = base(0), 0, 0, len(s) + 1
        for p in range(at, len(s)):
            c = s[p]
            if c == 0:
                read = p + 1
                break
            node ^= c
            if node >= n or xcda[node] & ((1 << 31) | 0xFF) != c:
                read = p + 1
                break
            leaf = (xcda[node] >> 8) & 1
            node ^= base(node)
            if node >= n:
                read = p + 1
                break
            if leaf:
                best_len, best_at = p - at + 1, xcda[node] & ((1 << 31) - 1)
        if not best_len:
            return None, read
        end = self.replacements.find(b"\0", best_at)
        if best_at >= len(self.replacements) or end < 0:
            raise ValueError("precompiled charsmap: unterminated replacement")
        return (self.replacements[best_at:end], best_len), read


class UgmTokenizer:
    def __init__(
        self,
        texts: StringArray,
        scores: np.ndarray,
        attrs: np.ndarray,
        unk: int,
        charsmap: bytes | None,
        options: UgmOptions,
    ) -> None:
        self._unk, self._opt = unk, options
        self._charsmap = Charsmap(charsmap) if charsmap else None
        normal = (attrs & A_NORMAL) != 0
        self._unknown_score = float(scores[normal].min() if normal.any() else np.float32(3.4028235e38)) - 10.0
        keep = np.flatnonzero((attrs & (A_NORMAL | A_USER_DEFINED | A_UNUSED)) != 0).tolist()
        user = set(np.flatnonzero((attrs & A_USER_DEFINED) != 0).tolist())
        self._ids = {texts.piece(i): i for i in keep}
        self._scores = [0.0 if i in user else float(scores[i]) for i in range(len(texts))]
        self._sorted = sorted(self._ids)  # prefix tests by bisection stand in for llama.cpp's trie
        self._user_sorted = sorted(texts.piece(i) for i in user)
        # ASCII bytes normalisation leaves alone between ASCII bytes (no charsmap key starts
        # there, no user-defined token starts with them; not the space): runs of them are
        # copied at once, up to the last one before a non-ASCII byte (a key may start there)
        plain = [
            c
            for c in range(1, 0x80)
            if c != 0x20
            and (self._charsmap is None or self._charsmap.keeps_in_ascii(c))
            and not _has_prefix(self._user_sorted, bytes((c,)))
        ]
        run = b"[" + b"".join(re.escape(bytes((c,))) for c in plain) + b"]+(?=[\\x00-\\x7f]|\\Z)"
        self._plain_run = re.compile(run).match
        self._user_first = frozenset(t[0] for t in self._user_sorted)
        self._chars: dict[bytes, tuple[bytes, int]] = {}  # a character -> its normalisation, where only it decides
        # prefixes of up to _SHORT bytes of the tokens: the Viterbi walk's "does a token go on?" in one lookup
        self._short = {t[:k] for t in self._ids for k in range(1, min(len(t), _SHORT) + 1)}
        self._cuts: bool | None = None  # may the Viterbi pass run word by word? (found on first use)
        self._cache: dict[bytes, list[int]] = {}
        self._native: NativeUgm | Literal[False] | None = None  # the C pass (built on first use), False: none
        self._texts, self._keep = texts, (attrs & (A_NORMAL | A_USER_DEFINED | A_UNUSED)) != 0
        self._flags: np.ndarray | None = None  # per code point: how its normalisation goes (_char_flags)
        self._rep: dict[str, str] = {}  # a character -> what the charsmap makes of it alone
        self._wide_cps = np.zeros(0, np.uint32)  # the _WIDE_NEXT code points seen, sorted
        self._wide_next = np.zeros((0, 256), bool)  # and for each, the bytes a key goes on with

    def encode(self, texts: list[str]) -> list[list[int]]:
        out = []
        for t in texts:
            s = self._normalize_text(t)
            out.append(self._encode(s if s is not None else self.normalize(t.encode("utf-8", "surrogateescape"))))
        return out

    def _encode(self, s: bytes) -> list[int]:
        """The Viterbi pass, word by word where that is the same: when no token reaches across
        the start of a "▁" (so every path goes through it), the best path is the best paths between
        them joined, and those repeat (a cache of words, as for BPE). The scores summed are float32
        values in doubles, exactly while the text is shorter than ~2^20 words, so the ties fall as
        in one pass; unknowns are merged again over the joins."""
        if self._cuts is None:
            self._cuts = not any(
                t[i] == _SPACE[0] and _SPACE.startswith(t[i : i + 3]) for t in self._ids for i in range(1, len(t))
            )
        if not self._cuts or not s.isascii() and not _valid_utf8(s):  # (a cut must be where Viterbi steps)
            return self._new_words([s])[0]
        if self._native is None:
            self._build_native()
        if self._native:  # all of it in C, its cache of words too
            return self._native.text(s)
        cache = self._cache
        if len(cache) > 1 << 17:
            cache.clear()
        parts = s.split(_SPACE)
        words = [_SPACE + w for w in parts[1:]]
        if parts[0]:
            words.insert(0, parts[0])
        found = list(map(cache.get, words))  # the cache first, in C; then the words it lacks
        if None in found:
            new = list(dict.fromkeys(compress(words, map(operator.is_, found, repeat(None)))))
            cache.update(zip(new, self._new_words(new)))
            found = list(map(cache.get, words))
        unk, out = self._unk, list[int]()
        for ids in found:
            assert ids is not None
            out += ids[1:] if ids[0] == unk and out and out[-1] == unk else ids
        return out

    # ---- normalisation -----------------------------------------------------------------------

    def _char_flags(self, cps: np.ndarray) -> np.ndarray:
        """Each code point's _KNOWN/_CHANGES/_WIDE_NEXT/_ALWAYS flags, classifying those not seen
        before all at once (Charsmap.walk_chars); their context-free normalisation in self._rep,
        and for _WIDE_NEXT ones the lead bytes a key goes on with in self._wide_next."""
        if self._flags is None:
            self._flags = np.zeros(0x110000, np.uint8)
        f = self._flags[cps]
        unseen = cps[f == 0]
        if len(unseen):
            marks = np.zeros(0x110000, bool)
            marks[unseen] = True
            new = np.flatnonzero(marks).astype(np.uint32)
            table, size = utf8_bytes(new)
            flags = np.full(len(new), _KNOWN, np.uint8)
            flags[np.isin(table[:, 0], list(self._user_first))] |= _ALWAYS
            if self._charsmap is not None:
                best_len, best_at, goes_on = self._charsmap.walk_chars(new)
                flags[(best_len > 0) & (best_len < size)] |= _ALWAYS  # a key ends inside the character
                flags[goes_on[:, :0x80].any(1)] |= _ALWAYS
                wide = goes_on.any(1) & ((flags & _ALWAYS) == 0)  # a key goes on only with a non-ASCII character
                flags[wide] |= _WIDE_NEXT
                if wide.any():
                    cps_all = np.concatenate([self._wide_cps, new[wide]])
                    order = np.argsort(cps_all, kind="stable")
                    self._wide_cps = cps_all[order]
                    self._wide_next = np.concatenate([self._wide_next, goes_on[wide]])[order]
                for i in np.flatnonzero(best_len == size).tolist():
                    try:
                        rep = self._charsmap.replacement(int(best_at[i])).decode()
                    except UnicodeDecodeError:
                        flags[i] |= _ALWAYS
                        continue
                    if rep != chr(new[i]):
                        self._rep[chr(new[i])] = rep
                        flags[i] |= _CHANGES
            self._flags[new] = flags
            f = self._flags[cps]
        return f

    def _normalize_text(self, text: str) -> bytes | None:
        """normalize(), on the code points rather than byte by byte: most characters are their
        own normalisation whatever follows them (found once per character, with numpy), so only
        the others are visited: a character the charsmap replaces alone, one per distinct
        character with str.replace; one where a key may go on, or a user-defined token start, by
        _normalize_prefix on the bytes from there. None where this does not apply (text that is
        not UTF-8, whitespace as a suffix), for normalize() to do."""
        o = self._opt
        if o.treat_whitespace_as_suffix or not text or "\0" in text:
            return None
        try:
            cps = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        except UnicodeEncodeError:
            return None  # surrogates: bytes that are not UTF-8
        f = self._char_flags(cps)
        goes_on = np.zeros(len(cps), bool)  # a key may go on into the next character
        wide = np.flatnonzero(f[:-1] & _WIDE_NEXT)
        wide = wide[cps[wide + 1] >= 0x80]
        if len(wide):
            lead = utf8_bytes(cps[wide + 1])[0][:, 0]
            goes_on[wide] = self._wide_next[np.searchsorted(self._wide_cps, cps[wide]), lead]
        visit = np.flatnonzero((f & (_CHANGES | _ALWAYS)) | goes_on)
        if len(visit):
            here = np.flatnonzero((f[visit] & _ALWAYS) | goes_on[visit])
            raws, done, at = [], [], 0
            for p in visit[here].tolist():
                if p < at:
                    continue  # inside what a key before it took
                piece = self._prefix_at(text, p)
                if piece is None:
                    return None
                raws.append(text[at:p])
                done.append(piece[0])
                at = p + piece[1]
            raws.append(text[at:])
            joined = "\0".join(raws)
            changed = [c for c in self._rep if c in joined] if len(self._rep) < 64 else None
            if changed is None:
                changed = [chr(c) for c in np.unique(cps[visit]).tolist() if chr(c) in self._rep]
            for c in changed:
                if any(c in self._rep[d] for d in changed) or "\0" in self._rep[c]:
                    return None  # a replacement that another would rewrite
            for c in changed:
                joined = joined.replace(c, self._rep[c])
            parts = joined.split("\0")
            text = "".join(x for pair in zip(parts, [*done, ""]) for x in pair)
        space = "\u2581" if o.escape_whitespaces else " "
        if o.remove_extra_whitespaces:  # one mark before each run of non-spaces
            words = text.split(" ")
            return (space + space.join(filter(None, words))).encode() if text.strip(" ") else b""
        first = len(text) - len(text.lstrip(" "))
        head, rest = text[:first].replace(" ", space), text[first:].replace(" ", space)
        return (head + (space if o.add_space_prefix and rest else "") + rest).encode()

    def _prefix_at(self, text: str, p: int) -> tuple[str, int] | None:
        """_normalize_prefix at text[p], on a window of bytes that holds all it reads: (the
        piece, the characters it took), or None if the piece is not whole characters."""
        size = 64
        while True:
            window = text[p : p + size].encode()
            more = p + size < len(text)  # the window ends before the text
            k = _longest_prefix(self._user_sorted, window, 0)
            if k:
                if k == len(window) and more:
                    size *= 4
                    continue
                piece, used = window[:k], k
                break
            hit, read = self._charsmap.match_reading(window, 0) if self._charsmap else (None, 1)
            if read > len(window) and more:
                size *= 4
                continue
            piece, used = hit if hit is not None else (window[: _utf8_size(window, 0)], _utf8_size(window, 0))
            break
        try:
            return piece.decode(), len(window[:used].decode())
        except UnicodeDecodeError:
            return None

    def normalize(self, text: bytes) -> bytes:
        o = self._opt
        space = _SPACE if o.escape_whitespaces else b" "
        prepend = not o.treat_whitespace_as_suffix and o.add_space_prefix
        merge = o.remove_extra_whitespaces
        out, prepended, in_word, at = bytearray(), False, False, 0
        plain_run, chars = self._plain_run, self._chars
        while at < len(text):
            if m := plain_run(text, at):  # what the loop below does for each such byte
                if not in_word:
                    in_word = True
                    if (prepend and not prepended) or merge:
                        out += space
                        prepended = True
                out += m.group()
                at = m.end()
                continue
            size = _UTF8_LEN[text[at] >> 4]
            hit = chars.get(text[at : at + size]) or chars.get(text[at : at + size + 1])
            if hit is None:
                piece, used = self._normalize_char(text, at, size)
            else:
                piece, used = hit
                at += used
                if piece == b" ":  # (a cached piece is one space or holds none)
                    in_word = False
                    if not merge:
                        out += space
                    continue
                if not in_word:
                    in_word = True
                    if (prepend and not prepended) or merge:
                        out += space
                        prepended = True
                out += piece
                continue
            for c in piece:
                if c != 0x20:
                    if not in_word:
                        in_word = True
                        if (prepend and not prepended) or merge:
                            out += space
                            prepended = True
                    out.append(c)
                else:
                    in_word = False
                    if not merge:
                        out += space
            at += used
        if o.treat_whitespace_as_suffix and o.add_space_prefix:
            out += space
        return bytes(out)

    def _normalize_char(self, s: bytes, at: int, size: int) -> tuple[bytes, int]:
        """_normalize_prefix, remembered when the character of `size` bytes at s[at] decided it
        (no user-defined token starts with its first byte, the charsmap walk stopped inside it, it
        is whole), or it and the byte after it did, and the result is one space or not empty and
        without spaces.
        The two keys differ in length for the same first byte: never confused."""
        if s[at] in self._user_first:
            return self._normalize_prefix(s, at)
        read = at
        hit = None
        if self._charsmap is not None:
            hit, read = self._charsmap.match_reading(s, at)
        if hit is None:
            n = _utf8_size(s, at)
            hit = (s[at : at + n], n) if n else ("\ufffd".encode(), 1)
        if (hit[0] == b" " or hit[0] and 0x20 not in hit[0]) and len(self._chars) < 1 << 17:
            if read <= at + size <= len(s):
                self._chars[s[at : at + size]] = hit
            elif read <= at + size + 1 <= len(s):
                self._chars[s[at : at + size + 1]] = hit
        return hit

    def _normalize_prefix(self, s: bytes, at: int) -> tuple[bytes, int]:
        # the longest prefix of a user-defined token (llama.cpp's trie walk stops where no token goes on)
        k = _longest_prefix(self._user_sorted, s, at)
        if k:
            return s[at : at + k], k
        if self._charsmap is not None and (hit := self._charsmap.match(s, at)) is not None:
            return hit
        size = _utf8_size(s, at)
        return (s[at : at + size], size) if size else ("\ufffd".encode(), 1)

    # ---- Viterbi -----------------------------------------------------------------------------

    def _new_words(self, words: list[bytes]) -> list[list[int]]:
        """The Viterbi pass over each word: in C (native.py) where it is built, else here."""
        if self._native is None:
            self._build_native()
        if self._native:
            return self._native.words(words)
        return [self._viterbi(w) for w in words]

    def _build_native(self) -> None:
        self._native = NativeUgm.build(self._texts, self._keep, self._scores, self._unk, self._unknown_score) or False

    def _viterbi(self, s: bytes, valid: bool = False) -> list[int]:
        """The best path over s, from each character start. With `valid` (s is UTF-8), tokens are
        tried only where characters end: a path that stops inside a character can neither go on
        (nothing starts there) nor end the text, so those ends change nothing."""
        n = len(s)
        if not n:
            return []
        unk, ids, scores, tokens, short = self._unk, self._ids, self._scores, self._sorted, self._short
        best_tok, best_from = [unk] * (n + 1), [0] * (n + 1)
        best = [-float("inf")] * (n + 1)
        best[0] = 0.0
        bounds = [i for i in range(n) if s[i] & 0xC0 != 0x80] + [n] if valid and not s.isascii() else None
        at = k = 0
        while at < n:
            ends: Sequence[int]
            if bounds is None:
                size, ends = min(_UTF8_LEN[s[at] >> 4], n - at), range(at + 1, n + 1)
            else:
                k += 1
                size, ends = bounds[k] - at, bounds[k:]
            here, whole = best[at], False
            for end in ends:
                tok = ids.get(s[at:end])
                if tok is None:  # llama.cpp's trie walk goes on while some token starts with this
                    if end - at <= _SHORT:
                        if s[at:end] not in short:
                            break
                    elif not _has_prefix(tokens, s[at:end]):
                        break
                else:
                    whole = whole or end - at == size
                    score = here + scores[tok]
                    if score > best[end]:
                        best[end], best_tok[end], best_from[end] = score, tok, at
            if not whole:
                score = here + self._unknown_score
                if score > best[at + size]:
                    best[at + size], best_tok[at + size], best_from[at + size] = score, unk, at
            at += size
        out: list[int] = []
        pos, prev_unknown = n, False
        while True:
            tok = best_tok[pos]
            if not (prev_unknown and tok == unk):
                out.append(tok)
            if best_from[pos] == 0:
                break
            prev_unknown, pos = tok == unk, best_from[pos]
        return out[::-1]


def _has_prefix(sorted_texts: list[bytes], prefix: bytes) -> bool:
    i = bisect.bisect_left(sorted_texts, prefix)
    return i < len(sorted_texts) and sorted_texts[i].startswith(prefix)


def _longest_prefix(sorted_texts: list[bytes], s: bytes, at: int) -> int:
    k = 0
    while at + k < len(s) and _has_prefix(sorted_texts, s[at : at + k + 1]):
        k += 1
    return k


def _valid_utf8(s: bytes) -> bool:
    try:
        s.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _utf8_size(s: bytes, at: int) -> int:
    """The length of the valid UTF-8 character at s[at] as llama.cpp checks it; 0 if invalid."""
    b = s[at]
    size = 1 if b < 0x80 else 0 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 0
    if size > 1 and (at + size > len(s) or any(s[at + k] & 0xC0 != 0x80 for k in range(1, size))):
        return 0
    return size


def utf8_bytes(cps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The UTF-8 bytes of code points (not surrogates), 4 columns padded with 0, and their lengths."""
    cp = cps.astype(np.int64)
    size = 1 + (cp >= 0x80).astype(np.int64) + (cp >= 0x800) + (cp >= 0x10000)
    out = np.zeros((len(cp), 4), np.int64)
    out[:, 0] = np.choose(size - 1, [cp, 0xC0 | cp >> 6, 0xE0 | cp >> 12, 0xF0 | cp >> 18])
    for k in range(1, 4):
        shift = np.maximum(6 * (size - 1 - k), 0)
        out[:, k] = np.where(k < size, 0x80 | (cp >> shift) & 0x3F, 0)
    return out, size
