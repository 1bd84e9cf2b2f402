"""The vocabulary exactly as llama.cpp's llama-vocab.cpp reads it, whatever its tokenizer.

One class holds what every kind shares: the token texts (one StringArray with a TokenIndex over
it: no Python object per token), their attributes, the special and end-of-generation tokens, the
partition of a text around special tokens and detokenisation. The algorithm between the special
tokens is chosen by tokenizer.ggml.model, one module each: SPM ("llama", spm.py), BPE ("gpt2",
"gemma4", "whitespace", bpe.py, with the pre-tokeniser named by tokenizer.ggml.pre) and WPM
("bert", wpm.py) and Unigram ("t5", ugm.py). Consumers read a token's text through token_to_piece (its bytes as printed),
never the stored text: a byte-level BPE token's stored text is an encoding of its bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.metadata import bad_value, is_int, meta_bool
from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab.bpe import BpeTokenizer, byte_decode
from ubatch.engine.vocab.partition import group_specials, partition
from ubatch.engine.vocab.pre_tokenizer import PRE_TOKENIZERS, UNSUPPORTED_PRE, PreTokenizer
from ubatch.engine.vocab.spm import _UNBUILT, SP_MIN_CHARS, SpmTokenizer
from ubatch.engine.vocab.tables import (
    A_BYTE,
    A_CONTROL,
    A_LSTRIP,
    A_NORMAL,
    A_RSTRIP,
    A_UNUSED,
    A_USER_DEFINED,
    AUTO_SPECIAL_TEXTS,
    EOG_TEXTS,
    HIDDEN_ATTRS,
    NORMAL,
    SPM_SPACE,
    TYPE_ATTR,
    UNSUPPORTED_MODELS,
)
from ubatch.engine.vocab.token_index import TokenIndex
from ubatch.engine.vocab.ugm import UgmOptions, UgmTokenizer
from ubatch.engine.vocab.wpm import WpmTokenizer, max_chars

if TYPE_CHECKING:
    from sentencepiece import SentencePieceProcessor

__all__ = ["SP_MIN_CHARS", "Vocab", "_UNBUILT"]

_SPACE_BYTES = SPM_SPACE.encode()
_CLEAN_MARKS = (b" ?", b" !", b" .", b" ,", b" '")  # only these can change in clean_spaces
KINDS = {"llama": "SPM", "gpt2": "BPE", "gemma4": "BPE", "whitespace": "BPE", "bert": "WPM", "t5": "UGM"}


# plain pieces `token_to_piece` keeps (the tokens a server generates most come first)
PIECES_KEPT = 1 << 16


@dataclass(frozen=True)
class KindDefaults:
    """What llama.cpp assumes for a vocabulary kind before reading the file's keys."""

    bos: int | None = 1
    eos: int | None = 2
    unk: int | None = 0
    sep: int | None = None
    pad: int | None = None
    mask: int | None = None
    add_space_prefix: bool = True
    add_bos: bool = True
    add_eos: bool = False
    add_sep: bool = False
    clean_spaces: bool = False


def kind_defaults(kind: str, model: str, pre: PreTokenizer | None) -> KindDefaults:
    """llama_vocab::impl::load's defaults by tokenizer model (and BPE pre-tokeniser)."""
    if kind == "WPM":
        return KindDefaults(101, None, 100, 102, 0, 103, add_space_prefix=False, add_sep=True, clean_spaces=True)
    if kind == "UGM":
        return KindDefaults(None, 1, 2, None, 0, add_space_prefix=False, add_bos=False, add_eos=True)
    if kind == "BPE":
        assert pre is not None
        ids = None if model == "gemma4" else 11  # llama.cpp's BPE default: 11 for both (Falcon's)
        return KindDefaults(
            None if pre.no_bos else ids,
            ids,
            None,
            add_space_prefix=False,
            add_bos=pre.add_bos,
            add_sep=pre.add_sep,
            clean_spaces=pre.clean_spaces,
        )
    return KindDefaults()


class Tokenizer(Protocol):
    """One algorithm: the raw fragments between special tokens -> their ids, in order."""

    def encode(self, texts: list[str]) -> list[list[int]]: ...


def _numbers(metadata: Mapping[str, object], key: str, n: int, dtype: type, source: str) -> np.ndarray | None:
    """A per-token numeric array (scores, types): absent or empty is None, else exactly n numbers."""
    v = metadata.get(key)
    if v is None or (isinstance(v, (list, np.ndarray)) and len(v) == 0):
        return None
    arr = np.asarray(v) if isinstance(v, (list, np.ndarray)) else None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iuf" or len(arr) != n:
        raise bad_value(source, key, v, f"an array of {n} numbers, one per token")
    return arr.astype(dtype, copy=False)  # the file's own array when it is already that type


def _strings(metadata: Mapping[str, object], key: str, source: str) -> StringArray | None:
    v = metadata.get(key)
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(t, str) for t in v):
        v = StringArray.from_strings(v)
    if not isinstance(v, StringArray):
        raise bad_value(source, key, v, "an array of strings")
    return v


class Vocab:
    """Token texts, scores and attributes plus llama.cpp's tokenize/detokenize rules."""

    n_tokens: int
    kind: str  # llama.cpp's vocab type: "SPM", "BPE", "WPM" or "UGM"
    model: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre as used ("default" when absent)
    bos: int
    eos: int
    eot: int | None
    unk: int | None
    pad: int | None
    sep: int | None
    mask: int | None
    nl: int | None  # llama_vocab_nl: the <0x0A> byte token for SPM, the ids of "\n" for BPE
    add_bos: bool
    add_eos: bool
    add_sep: bool
    add_space_prefix: bool
    clean_spaces: bool
    eog: frozenset[int]
    warnings: list[str]  # what llama.cpp would warn about at load, for the caller to show

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
        if model not in KINDS:
            kind = f" ({UNSUPPORTED_MODELS[model]})" if model in UNSUPPORTED_MODELS else ""
            raise ModelLoadError(
                f"{source}: tokenizer '{model}'{kind} is not supported; "
                "SentencePiece ('llama'), BPE ('gpt2', 'gemma4'), WordPiece ('bert') and Unigram ('t5') vocabularies are"
            )
        tokens = _strings(metadata, "tokenizer.ggml.tokens", source)
        if tokens is None or not len(tokens):
            raise bad_value(
                source, "tokenizer.ggml.tokens", metadata.get("tokenizer.ggml.tokens"), "a non-empty array of strings"
            )
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
        model = str(metadata.get("tokenizer.ggml.model", "llama"))
        self.model, self.kind, self.warnings = model, KINDS[model], []
        n = self.n_tokens = len(tokens)
        if np.any(tokens.lengths() == 0):  # (rare) an empty text gets a placeholder, as llama.cpp's
            tokens = StringArray.from_strings(t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens))
        self._text, self._blob, self._off = tokens, tokens.blob, tokens.off
        self._id = TokenIndex(tokens)
        if (dup := self._id.duplicate) is not None:
            raise ModelLoadError(f"{source}: duplicate token {tokens[dup]!r} in the vocabulary")
        lut = np.zeros(max(TYPE_ATTR) + 1, np.uint16)
        lut[list(TYPE_ATTR)] = list(TYPE_ATTR.values())
        known = (types >= 0) & (types < len(lut))
        attr = self._attr = np.where(known, lut[np.where(known, types, 0)], 0).astype(np.uint16)
        self._attr_of = attr.data  # fast scalar reads (detokenisation)
        self._piece_memo: dict[int, bytes] = {}  # token_to_piece's plain pieces

        # llama.cpp's per-kind defaults, then what the file says
        pre = self._pre_tokenizer(metadata, source)
        d = kind_defaults(self.kind, model, pre)
        self.add_bos, self.add_eos, self.add_sep, self.clean_spaces = d.add_bos, d.add_eos, d.add_sep, d.clean_spaces
        self.add_space_prefix = meta_bool(metadata, "tokenizer.ggml.add_space_prefix", source, d.add_space_prefix)

        def key(name: str, default: int | None) -> int | None:
            v = metadata.get(f"tokenizer.ggml.{name}")  # out-of-range ids ignored, as llama.cpp
            if v is not None and not is_int(v):
                raise bad_value(source, f"tokenizer.ggml.{name}", v, "a token id")
            tok = v if isinstance(v, int) and 0 <= v < n else default
            return tok if tok is not None and 0 <= tok < n else None

        bos, eos = key("bos_token_id", d.bos), key("eos_token_id", d.eos)
        self.unk, self.sep = key("unknown_token_id", d.unk), key("seperator_token_id", d.sep)
        self.pad, self.mask = key("padding_token_id", d.pad), key("mask_token_id", d.mask)
        if self.kind == "SPM" and (bos is None or eos is None or self.unk is None):
            raise ModelLoadError(f"{source}: the tokenizer has no valid bos/eos/unknown token id")
        eos_is_eog = eos is not None
        eos = eos if eos is not None else self.sep  # WordPiece has no EOS; [SEP] ends a text
        bos = bos if bos is not None or self.kind != "UGM" else eos  # T5 has no BOS (and adds none)
        if bos is None or eos is None:
            raise ModelLoadError(f"{source}: the tokenizer has no valid bos/eos token id")
        self.bos, self.eos = bos, eos
        self.add_bos = meta_bool(metadata, "tokenizer.ggml.add_bos_token", source, self.add_bos)
        self.add_eos = meta_bool(metadata, "tokenizer.ggml.add_eos_token", source, self.add_eos)
        self.add_sep = meta_bool(metadata, "tokenizer.ggml.add_sep_token", source, self.add_sep)
        if pre is not None and pre.type == "GEMMA4" and not self.add_bos:
            self.add_bos = True
            self.warnings.append("tokenizer.ggml.add_bos_token overridden to true for Gemma 4, as llama.cpp does")
        file_attr = attr.copy()  # what llama.cpp's Unigram trie is built from, before the text rules
        self._mark_specials(attr, eos if eos_is_eog else None, lambda name: key(name, None))

        # Special-token list: longest (in bytes) first; ties by id (llama.cpp leaves them open).
        special = np.flatnonzero(attr & (HIDDEN_ATTRS | A_USER_DEFINED))
        special = special[np.argsort(-tokens.lengths()[special], kind="stable")].tolist()
        self._set_strip_attrs(attr, special, metadata, pre)
        special_texts = {i: tokens[i] for i in special}  # one str per special, shared by both groupings
        self._specials = {
            True: group_specials(special, special_texts),
            False: group_specials([i for i in special if not attr[i] & HIDDEN_ATTRS], special_texts),
        }
        self._strip = {
            i: (bool(attr[i] & A_LSTRIP), bool(attr[i] & A_RSTRIP)) for i in special if attr[i] & (A_LSTRIP | A_RSTRIP)
        }

        self._pre = pre
        self._spm: SpmTokenizer | None = None
        self._tok = self._tokenizer(tokens, scores, file_attr, metadata, source, sp_min_chars)
        if self.kind == "SPM":
            self.nl = self._id.get("<0x0A>", self._id.get("\n", self.pad))
        elif self.kind == "WPM":
            self.nl = self.pad
        else:  # llama.cpp tokenizes "\n" (before any special token is known)
            self.nl = next(iter(self._tok.encode(["\n"])[0]), self.pad)

    def _tokenizer(
        self,
        tokens: StringArray,
        scores: np.ndarray,
        file_attr: np.ndarray,
        metadata: Mapping[str, object],
        source: str,
        sp_min_chars: int | None,
    ) -> Tokenizer:
        """The algorithm of this kind (llama_vocab::impl::init_tokenizer)."""
        what = {"SPM": "", "WPM": "WordPiece ", "UGM": "Unigram ", "BPE": "BPE "}[self.kind]
        if self.kind != "BPE" and self.unk is None:
            raise ModelLoadError(f"{source}: the {what}vocabulary has no valid unknown token id")
        lowercase = meta_bool(
            metadata,
            "tokenizer.ggml.normalizer.lowercase",
            source,
            True if self._pre is None or self._pre.lowercase is None else self._pre.lowercase,
        )
        unk = self.unk if self.unk is not None else -1
        if self.kind == "SPM":
            self._spm = SpmTokenizer(tokens, self._id, scores, unk, sp_min_chars)
            return self._spm
        if self.kind == "WPM":
            strip_accents = meta_bool(metadata, "tokenizer.ggml.normalizer.strip_accents", source, lowercase)
            return WpmTokenizer(tokens, max_chars(tokens.lengths()), unk, lowercase, strip_accents)
        if self.kind == "UGM":
            charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
            blob = np.asarray(charsmap).astype(np.uint8).tobytes() if charsmap is not None else None
            remove_extra = meta_bool(metadata, "tokenizer.ggml.remove_extra_whitespaces", source, False)
            try:
                return UgmTokenizer(
                    tokens, scores, file_attr, unk, blob, UgmOptions(self.add_space_prefix, remove_extra)
                )
            except ValueError as e:
                raise ModelLoadError(f"{source}: tokenizer.ggml.precompiled_charsmap: {e}") from None
        assert self._pre is not None
        merges = _strings(metadata, "tokenizer.ggml.merges", source)
        if merges is None:
            raise ModelLoadError(f"{source}: the BPE vocabulary has no merges (tokenizer.ggml.merges)")
        return BpeTokenizer(tokens, merges, self._pre, self.model == "whitespace", lowercase)

    def _pre_tokenizer(self, metadata: Mapping[str, object], source: str) -> PreTokenizer | None:
        """llama.cpp's tokenizer.ggml.pre lookup (BPE only): absent or unknown -> 'default' with a
        warning. (llama.cpp refuses an unknown name; a file from a newer converter still loads here,
        and the warning says its words may split differently.)"""
        raw = metadata.get("tokenizer.ggml.pre")
        self.pre = raw if isinstance(raw, str) else "default"
        if self.kind != "BPE":
            return None
        if self.model == "gemma4":
            self.pre = "gemma4"
        elif not raw:
            self.warnings.append(
                "the vocabulary names no pre-tokenizer (tokenizer.ggml.pre); using 'default', "
                "generation quality will be degraded: consider regenerating the model"
            )
        if self.pre not in PRE_TOKENIZERS:
            self.warnings.append(
                f"unknown pre-tokenizer type {self.pre!r} (tokenizer.ggml.pre); using 'default', "
                "words may be split unlike the model's own tokenizer (llama.cpp refuses this file)"
            )
            self.pre = "default"
        pre = PRE_TOKENIZERS[self.pre]
        if pre.type in UNSUPPORTED_PRE:
            raise ModelLoadError(f"{source}: pre-tokenizer '{self.pre}' is not supported ({UNSUPPORTED_PRE[pre.type]})")
        return pre

    def _mark_specials(self, attr: np.ndarray, eos: int | None, meta_id: Callable[[str], int | None]) -> None:
        """llama.cpp's load-time rules by token text: special ids, unused, end of generation."""
        ids = self._id

        def force_control(tok: int) -> int:
            attr[tok] |= A_CONTROL  # llama.cpp: "control-looking token ... will be overridden"
            return tok

        # llama.cpp takes the first match in hash-map order; we take the lowest id.
        found = {name: meta_id(f"{name}_token_id") for name in AUTO_SPECIAL_TEXTS}
        for name, texts in AUTO_SPECIAL_TEXTS.items():
            hits = sorted(ids[t] for t in texts if t in ids)
            if found[name] is None and hits:
                found[name] = force_control(hits[0])
        self.eot = found["eot"]
        for i in np.flatnonzero(attr & A_CONTROL).tolist():  # control tokens named "unused" are also UNUSED
            if "unused" in self._text[i]:
                attr[i] |= A_UNUSED
        eog = {t for k in ("fim_pad", "fim_rep", "fim_sep") if (t := found[k]) is not None}
        eog |= {force_control(ids[t]) for t in EOG_TEXTS if t in ids}
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always printed
            if text in ids:
                attr[ids[text]] = A_USER_DEFINED
        eog |= {t for t in (eos, self.eot, found["eom"]) if t is not None}
        eog_texts = {self._text[i]: i for i in eog}
        has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
        if "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
            end = eog_texts["<|end|>"]  # o200k_harmony / solar-open: <|end|> ends a message, not generation
            eog.discard(end)
            attr[end] = A_USER_DEFINED
        if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
            eog.discard(eog_texts["</s>"])  # gemma4/plamo: a normal </s>, unlike paddleocr's
            attr[eog_texts["</s>"]] = A_NORMAL
        self.eog = frozenset(eog)

    def _set_strip_attrs(
        self, attr: np.ndarray, special: list[int], metadata: Mapping[str, object], pre: PreTokenizer | None
    ) -> None:
        """llama.cpp's per-model LSTRIP/RSTRIP (not in the GGUF file): by model, pre or arch name."""
        name = str(metadata.get("general.name", "")).lower()
        pre_name = str(metadata.get("tokenizer.ggml.pre", ""))
        arch = str(metadata.get("general.architecture", ""))
        ids = self._id

        def set_attr(text: str, bit: int, on: bool) -> None:
            if text in ids:
                attr[ids[text]] = attr[ids[text]] | bit if on else attr[ids[text]] & (0xFFFF ^ bit)

        if any(s in pre_name for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert")) or any(
            s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
        ):
            set_attr("<mask>", A_LSTRIP, True)
        elif "phi-3" in name or "phi3" in name:
            for i in special:
                attr[i] |= A_RSTRIP
            set_attr("</s>", A_RSTRIP, True)
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                set_attr(t, A_RSTRIP, False)
        elif "modern-bert" in name:
            set_attr("[MASK]", A_LSTRIP, True)

    # ---- tokenisation ------------------------------------------------------------------------

    @property
    def _sp(self) -> SentencePieceProcessor | None:
        """The SPM vocabulary's sentencepiece processor (built on first use)."""
        return self._spm._sp if self._spm is not None else None

    @property
    def _processor(self) -> object:
        return self._spm._processor if self._spm is not None else None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Ids of `text`. add_special: BOS/EOS (WordPiece: CLS/SEP) as the vocab asks;
        parse_special: control texts become their tokens."""
        frags = partition(text, self._specials[parse_special], self._strip)
        prev_special, raw = True, []
        escape = self._pre is not None and self._pre.escape_whitespaces
        for i, f in enumerate(frags):
            if isinstance(f, str):
                if self.kind == "SPM" and self.add_space_prefix and prev_special:  # after a special or at start
                    frags[i] = f = " " + f
                elif escape:
                    frags[i] = f = f.replace(" ", SPM_SPACE)
                raw.append(f)
            prev_special = not isinstance(f, str)
        encoded = iter(self._tok.encode(raw))
        wpm = self.kind == "WPM"
        out = [self.bos] if add_special and (self.add_bos or wpm) else []
        for f in frags:
            out.extend(next(encoded) if isinstance(f, str) else [f])
        if add_special and wpm and self.sep is not None:
            out.append(self.sep)
        return out + [self.eos] if add_special and self.add_eos and not wpm else out

    # ---- detokenisation ----------------------------------------------------------------------

    def is_eog(self, tok: int) -> bool:
        return tok in self.eog

    def token_text(self, tok: int) -> str:
        """The stored text (byte-level BPE: an encoding of the bytes; print token_to_piece)."""
        return self._text[tok]

    def token_to_piece(self, tok: int, special: bool = False) -> bytes:
        """One token's bytes: control/unknown only if `special`; ▁ -> space; bytes raw. The
        plain pieces are kept once asked (a generation asks for each token it samples), for at
        most PIECES_KEPT tokens."""
        if special:
            return self._token_to_piece(tok, True)
        piece = self._piece_memo.get(tok)
        if piece is None:
            piece = self._token_to_piece(tok, False)
            if len(self._piece_memo) < PIECES_KEPT:
                self._piece_memo[tok] = piece
        return piece

    def _token_to_piece(self, tok: int, special: bool) -> bytes:
        attr = self._attr_of[tok]
        if attr & HIDDEN_ATTRS and not special:
            return b""  # also for </s>, user-defined but forced to CONTROL as an EOG token
        if tok < 0:
            tok += self.n_tokens  # (a list's negative index, as before)
        piece = self._blob[self._off[tok] : self._off[tok + 1]]
        if attr & (HIDDEN_ATTRS | A_USER_DEFINED):
            return piece
        if attr & A_NORMAL:
            if self.kind != "BPE" or self._pre is not None and self._pre.escape_whitespaces:
                return piece.replace(_SPACE_BYTES, b" ")
            return byte_decode(piece.decode("utf-8", "surrogatepass"))
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
        text = b"".join(pieces)
        if self.clean_spaces and any(m in text for m in _CLEAN_MARKS):
            text = clean_spaces(text)
        return text.decode("utf-8", errors="replace")


def clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces, its three in-place passes step for step:
    " ?" " !" " ." " ," lose the space, " ' " loses both, " 's" " 'm" " 're" " 've" lose it."""
    t = bytearray(text)
    total = 1 if t else 0
    for i in range(1, len(t)):  # pass 1
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    n, total, i = total, 1 if total else 0, 1
    while i < n:  # pass 2
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    n, total = total, 1 if total else 0
    for i in range(1, n):  # pass 3
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n and (x1, t[i + 2]) in ((0x72, 0x65), (0x76, 0x65)):
                total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])
