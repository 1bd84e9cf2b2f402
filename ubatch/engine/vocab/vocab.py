"""The SPM tokenizer (tokenizer.ggml.model "llama") exactly as llama.cpp's llama-vocab.cpp runs it.

tokenize = special-token partitioning ("global longest first", done here) + llama.cpp's
score-driven merge loop on each raw fragment. Texts of SP_MIN_CHARS or more run the loop in
`sentencepiece`, from a BPE ModelProto built out of the GGUF vocabulary the first time one comes
(reference/gguf-models.md §4.6): it is ~10x faster than the pure-Python loop (engine/vocab/spm_merge.py),
but its 262,144 pieces cost ~40 MiB that a short prompt does not need. Shorter texts, and
vocabularies sentencepiece cannot express (no byte tokens, no unknown token), take the Python loop.
The texts live in one StringArray with a TokenIndex over it: no Python object per token.
Detokenisation follows §4.4.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.metadata import bad_value, is_int, meta_bool
from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab.partition import group_specials, partition
from ubatch.engine.vocab.spm_merge import spm_merge
from ubatch.engine.vocab.spm_model import sentencepiece_for
from ubatch.engine.vocab.tables import (
    A_BYTE,
    A_CONTROL,
    A_NORMAL,
    A_UNUSED,
    A_USER_DEFINED,
    AUTO_SPECIAL_TEXTS,
    BYTE_TEXTS,
    EOG_TEXTS,
    HIDDEN_ATTRS,
    NORMAL,
    SPM_SPACE,
    TYPE_ATTR,
    UNSUPPORTED_MODELS,
)
from ubatch.engine.vocab.token_index import TokenIndex

if TYPE_CHECKING:
    from sentencepiece import SentencePieceProcessor

SP_MIN_CHARS = 256  # a call whose raw fragments hold this many characters takes sentencepiece
_SPACE_BYTES = SPM_SPACE.encode()


class _Unbuilt(enum.Enum):
    UNBUILT = "unbuilt"


_UNBUILT = _Unbuilt.UNBUILT  # the sentencepiece processor before its first use


def _numbers(metadata: Mapping[str, object], key: str, n: int, dtype: type, source: str) -> np.ndarray | None:
    """A per-token numeric array (scores, types): absent or empty is None, else exactly n numbers."""
    v = metadata.get(key)
    if v is None or (isinstance(v, (list, np.ndarray)) and len(v) == 0):
        return None
    arr = np.asarray(v) if isinstance(v, (list, np.ndarray)) else None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iuf" or len(arr) != n:
        raise bad_value(source, key, v, f"an array of {n} numbers, one per token")
    return arr.astype(dtype, copy=False)  # the file's own array when it is already that type


class Vocab:
    """Token texts, scores and attributes plus llama.cpp's SPM tokenize/detokenize rules."""

    n_tokens: int
    bos: int
    eos: int
    eot: int | None
    unk: int
    pad: int | None
    nl: int | None  # llama_vocab_nl: the <0x0A> byte token for SPM, not the "\n" text token
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog: frozenset[int]

    @classmethod
    def from_metadata(
        cls,
        metadata: Mapping[str, object],
        source: str = "",
        *,
        use_sentencepiece: bool = True,
        sp_min_chars: int = SP_MIN_CHARS,
    ) -> Vocab:
        """Read the tokenizer.ggml.* keys; ModelLoadError (naming `source`) if we cannot."""
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError(f"{source}: no tokenizer in the file (no tokenizer.ggml.model)")
        if not isinstance(model, str):
            raise bad_value(source, "tokenizer.ggml.model", model, "a tokenizer name such as 'llama'")
        if model != "llama":
            kind = f" ({UNSUPPORTED_MODELS[model]})" if model in UNSUPPORTED_MODELS else ""
            raise ModelLoadError(
                f"{source}: tokenizer '{model}'{kind} is not supported; only SentencePiece vocabularies ('llama': Llama 2, Gemma) are"
            )
        tokens = metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens):
            tokens = StringArray.from_strings(tokens)
        if not isinstance(tokens, StringArray) or not len(tokens):
            raise bad_value(source, "tokenizer.ggml.tokens", tokens, "a non-empty array of strings")
        n = len(tokens)
        scores = _numbers(metadata, "tokenizer.ggml.scores", n, np.float32, source)
        types = _numbers(metadata, "tokenizer.ggml.token_type", n, np.int64, source)
        scores = np.zeros(n, np.float32) if scores is None else scores
        types = np.full(n, NORMAL) if types is None else types
        sp_min = sp_min_chars if use_sentencepiece else None
        return cls(tokens, scores, types, metadata, source, sp_min)

    def __init__(
        self,
        tokens: StringArray,
        scores: npt.NDArray[np.float32],
        types: npt.NDArray[np.int64],
        metadata: Mapping[str, object],
        source: str,
        sp_min_chars: int | None,
    ) -> None:
        n = self.n_tokens = len(tokens)
        if np.any(tokens.lengths() == 0):  # (rare) an empty text gets a placeholder, as llama.cpp's
            tokens = StringArray.from_strings(t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens))
        self._text, self._blob, self._off = tokens, tokens.blob, tokens.off
        self._scores = scores
        self._id = TokenIndex(tokens)
        if (dup := self._id.duplicate) is not None:
            raise ModelLoadError(f"{source}: duplicate token {tokens[dup]!r} in the vocabulary")
        lut = np.zeros(max(TYPE_ATTR) + 1, np.uint8)
        lut[list(TYPE_ATTR)] = list(TYPE_ATTR.values())
        known = (types >= 0) & (types < len(lut))
        attr = self._attr = np.where(known, lut[np.where(known, types, 0)], 0).astype(np.uint8)
        self._attr_of = attr.data  # fast scalar reads (detokenisation)

        def key(name: str, default: int | None) -> int | None:
            v = metadata.get(f"tokenizer.ggml.{name}")  # out-of-range ids ignored, as llama.cpp
            if v is not None and not is_int(v):
                raise bad_value(source, f"tokenizer.ggml.{name}", v, "a token id")
            tok = v if isinstance(v, int) and 0 <= v < n else default
            return tok if tok is not None and 0 <= tok < n else None

        bos, eos, unk = key("bos_token_id", 1), key("eos_token_id", 2), key("unknown_token_id", 0)
        if bos is None or eos is None or unk is None:
            raise ModelLoadError(f"{source}: the tokenizer has no valid bos/eos/unknown token id")
        self.bos, self.eos, self.unk, self.pad = bos, eos, unk, key("padding_token_id", None)
        self.add_bos = meta_bool(metadata, "tokenizer.ggml.add_bos_token", source, True)
        self.add_eos = meta_bool(metadata, "tokenizer.ggml.add_eos_token", source, False)
        self.add_space_prefix = meta_bool(metadata, "tokenizer.ggml.add_space_prefix", source, True)

        def force_control(tok: int) -> int:
            attr[tok] |= A_CONTROL  # llama.cpp: "control-looking token ... will be overridden"
            return tok

        # llama.cpp takes the first match in hash-map order; we take the lowest id.
        found = {name: key(f"{name}_token_id", None) for name in AUTO_SPECIAL_TEXTS}
        for name, texts in AUTO_SPECIAL_TEXTS.items():
            hits = sorted(self._id[t] for t in texts if t in self._id)
            if found[name] is None and hits:
                found[name] = force_control(hits[0])
        self.eot = found["eot"]
        for i in np.flatnonzero(attr & A_CONTROL).tolist():  # control tokens named "unused" are also UNUSED
            if "unused" in tokens[i]:
                attr[i] |= A_UNUSED
        eog = {t for k in ("fim_pad", "fim_rep", "fim_sep") if (t := found[k]) is not None}
        eog |= {force_control(self._id[t]) for t in EOG_TEXTS if t in self._id}
        eog |= {t for t in (eos, self.eot, found["eom"]) if t is not None}
        eog_texts = {tokens[i] for i in eog}  # (llama.cpp's BPE-only <|end|> rule is left out)
        if "<|tool_response>" in eog_texts and "</s>" in eog_texts:  # gemma4/paddleocr: </s> is no EOG
            eog.discard(self._id["</s>"])
            attr[self._id["</s>"]] = A_NORMAL
        self.eog = frozenset(eog)
        self.nl = self._id.get("<0x0A>", self._id.get("\n", self.pad))

        # Special-token list: longest (in bytes) first; ties by id (llama.cpp leaves them open).
        special = np.flatnonzero(attr & (HIDDEN_ATTRS | A_USER_DEFINED))
        special = special[np.argsort(-tokens.lengths()[special], kind="stable")].tolist()
        special_texts = {i: tokens[i] for i in special}  # one str per special, shared by both groupings
        self._specials = {
            True: group_specials(special, special_texts),
            False: group_specials([i for i in special if not attr[i] & HIDDEN_ATTRS], special_texts),
        }
        self._suspects: list[str] = []
        self.sp_min_chars = sp_min_chars  # None: never sentencepiece
        self._processor: SentencePieceProcessor | None | _Unbuilt = _UNBUILT

    # ---- tokenisation ------------------------------------------------------------------------

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

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Ids of `text`. add_special: BOS/EOS as the vocab asks; parse_special: control texts."""
        frags = partition(text, self._specials[parse_special])
        prev_special, raw = True, []
        for i, f in enumerate(frags):
            if isinstance(f, str):
                if self.add_space_prefix and prev_special:  # after a special token or at start
                    frags[i] = f = " " + f
                raw.append(f)
            prev_special = not isinstance(f, str)
        encoded = iter(self._encode(raw))
        out = [self.bos] if add_special and self.add_bos else []
        for f in frags:
            out.extend(next(encoded) if isinstance(f, str) else [f])
        return out + [self.eos] if add_special and self.add_eos else out

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # short texts take the Python loop: sentencepiece is only built for a text that needs its speed
        if self.sp_min_chars is None or sum(map(len, texts)) < self.sp_min_chars or self._sp is None:
            return [self._merge(t) for t in texts]
        if self._suspects and any(s in t for s in self._suspects for t in texts):
            return [self._merge(t) if any(s in t for s in self._suspects) else self._sp.encode(t) for t in texts]
        return self._sp.encode(texts)

    def _merge(self, text: str) -> list[int]:
        """llama.cpp's SPM merge loop on one raw fragment, in pure Python (the fallback)."""
        return spm_merge(text, self._id.get, self._scores, self._byte)

    def _byte(self, b: int) -> int:
        tok = self._id.get(BYTE_TEXTS[b], self._id.get(chr(b)) if b < 0x80 else None)
        return self.unk if tok is None else tok  # where llama.cpp would throw

    # ---- detokenisation ----------------------------------------------------------------------

    def is_eog(self, tok: int) -> bool:
        return tok in self.eog

    def token_text(self, tok: int) -> str:
        return self._text[tok]

    def token_to_piece(self, tok: int, special: bool = False) -> bytes:
        """One token's bytes: control/unknown only if `special`; ▁ -> space; bytes raw."""
        attr = self._attr_of[tok]
        if attr & HIDDEN_ATTRS and not special:
            return b""  # also for </s>, user-defined but forced to CONTROL as an EOG token
        if tok < 0:
            tok += self.n_tokens  # (a list's negative index, as before)
        piece = self._blob[self._off[tok] : self._off[tok + 1]]
        if attr & (HIDDEN_ATTRS | A_USER_DEFINED):
            return piece
        if attr & A_NORMAL:
            return piece.replace(_SPACE_BYTES, b" ")
        if attr & A_BYTE:
            return bytes([int(piece[3:5], 16)])
        return b""  # unused / undefined types print nothing

    def detokenize(self, ids: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of `ids` (llama_detokenize): pieces joined as bytes, decoded once at the end."""
        ids = list(ids)
        strip_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos:
            strip_space, ids = False, ids[1:]  # a removed BOS keeps the first piece's space
        if remove_special and self.add_eos and ids and ids[-1] == self.eos:
            ids = ids[:-1]
        pieces = [self.token_to_piece(t, unparse_special) for t in ids]
        if strip_space and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")
