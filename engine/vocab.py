"""The SPM tokenizer (tokenizer.ggml.model "llama") exactly as llama.cpp's llama-vocab.cpp runs it.

tokenize = special-token partitioning ("global longest first", done here) + llama.cpp's
score-driven merge loop on each raw fragment. The merge loop runs in `sentencepiece`, from a BPE
ModelProto built out of the GGUF vocabulary (reference/gguf-models.md §4.6): it is several times
faster than the pure-Python loop below, which stays as the fallback for vocabularies that
sentencepiece cannot express (no byte tokens, no unknown token). Detokenisation follows §4.4.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ModelLoadError
from .metadata import bad_value, is_int, meta_bool
from .spm_merge import spm_merge
from .vocab_tables import (
    A_BYTE,
    A_CONTROL,
    A_NORMAL,
    A_UNUSED,
    A_USER_DEFINED,
    AUTO_SPECIAL_TEXTS,
    BYTE,
    BYTE_TEXTS,
    EOG_TEXTS,
    HIDDEN_ATTRS,
    NORMAL,
    SPM_SPACE,
    TYPE_ATTR,
    UNKNOWN,
    UNSUPPORTED_MODELS,
)


def _numbers(metadata: dict[str, Any], key: str, n: int, dtype: type, source: str) -> np.ndarray | None:
    """A per-token numeric array (scores, types): absent or empty is None, else exactly n numbers."""
    v = metadata.get(key)
    if v is None or (isinstance(v, (list, np.ndarray)) and len(v) == 0):
        return None
    arr = np.asarray(v) if isinstance(v, (list, np.ndarray)) else None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iuf" or len(arr) != n:
        raise bad_value(source, key, v, f"an array of {n} numbers, one per token")
    return arr.astype(dtype)


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
    def from_metadata(cls, metadata: dict[str, Any], source: str = "", *, use_sentencepiece: bool = True) -> Vocab:
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
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise bad_value(source, "tokenizer.ggml.tokens", tokens, "a non-empty array of strings")
        n = len(tokens)
        scores = _numbers(metadata, "tokenizer.ggml.scores", n, np.float32, source)
        types = _numbers(metadata, "tokenizer.ggml.token_type", n, np.int64, source)
        scores = np.zeros(n, np.float32) if scores is None else scores
        types = np.full(n, NORMAL) if types is None else types
        return cls(list(tokens), scores, types.tolist(), metadata, source, use_sentencepiece)

    def __init__(
        self,
        tokens: list[str],
        scores: np.ndarray,
        types: list[int],
        metadata: dict[str, Any],
        source: str,
        use_sentencepiece: bool,
    ) -> None:
        n = self.n_tokens = len(tokens)
        self._text = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._scores = scores
        self._id = {t: i for i, t in enumerate(self._text)}
        if len(self._id) != n:
            dup = next(t for i, t in enumerate(self._text) if self._id[t] != i)
            raise ModelLoadError(f"{source}: duplicate token {dup!r} in the vocabulary")
        attr = self._attr = [TYPE_ATTR.get(t, 0) for t in types]

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
        for i, t in enumerate(self._text):  # control tokens named "unused" are also UNUSED
            if attr[i] & A_CONTROL and "unused" in t:
                attr[i] |= A_UNUSED
        eog = {found[k] for k in ("fim_pad", "fim_rep", "fim_sep")} - {None}
        eog |= {force_control(self._id[t]) for t in EOG_TEXTS if t in self._id}
        eog |= {t for t in (eos, self.eot, found["eom"]) if t is not None}
        texts = {self._text[i] for i in eog}  # (llama.cpp's BPE-only <|end|> rule is left out)
        if "<|tool_response>" in texts and "</s>" in texts:  # gemma4/paddleocr: </s> is no EOG
            eog.discard(self._id["</s>"])
            attr[self._id["</s>"]] = A_NORMAL
        self.eog = frozenset(eog)  # type: ignore[arg-type]
        self.nl = self._id.get("<0x0A>", self._id.get("\n", self.pad))

        # Special-token list: longest (in bytes) first; ties by id (llama.cpp leaves them open).
        special = sorted(
            (i for i in range(n) if attr[i] & (HIDDEN_ATTRS | A_USER_DEFINED)),
            key=lambda i: -len(self._text[i].encode()),
        )
        self._specials = {
            True: _group(special, self._text),
            False: _group([i for i in special if not attr[i] & HIDDEN_ATTRS], self._text),
        }
        self._suspects: list[str] = []
        self._sp = self._build_sentencepiece() if use_sentencepiece else None

    # ---- tokenisation ------------------------------------------------------------------------

    def _build_sentencepiece(self) -> Any | None:
        """A BPE ModelProto whose merge loop is llama.cpp's; None if the vocab cannot be one."""
        byte_ids = [self._id.get(t) for t in BYTE_TEXTS]
        if None in byte_ids or self._text[self.unk] in BYTE_TEXTS:
            return None
        import sentencepiece as spm

        from .spm_model import bpe_model_proto

        # All other pieces are NORMAL so merges reach control/user-defined tokens as in llama.cpp
        # (we split special texts out ourselves). SentencePiece never merges into byte/unknown
        # pieces, llama.cpp could: fragments holding such a buildable text take the Python loop.
        reserved = {self.unk, *byte_ids}
        self._suspects = [self._text[i] for i in reserved if self._buildable(self._text[i])]
        kinds = [UNKNOWN if i == self.unk else BYTE if i in reserved else NORMAL for i in range(self.n_tokens)]
        try:
            return spm.SentencePieceProcessor(model_proto=bpe_model_proto(self._text, self._scores, kinds, self.unk))
        except RuntimeError:
            return None

    def _buildable(self, text: str) -> bool:
        """Could the merge loop build `text`? Its last merge joins two tokens or single chars."""
        ok = lambda s: len(s) == 1 or s in self._id  # noqa: E731
        return any(ok(text[:k]) and ok(text[k:]) for k in range(1, len(text)))

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: split special texts out, longest token first."""
        # Only specials present in the whole text can split a fragment. A 3-char prefix test
        # skips most groups; big groups (6,242 "<unusedN>") are matched at each prefix hit.
        present: set[tuple[int, str, int]] = set()
        for prefix, (members, lengths) in self._specials[parse_special].items():
            if prefix not in text:
                continue
            if len(members) <= 16:
                present.update(m for t, m in members.items() if t in text)
                continue
            pos = text.find(prefix)
            while pos >= 0:
                present.update(members[t] for k in lengths if (t := text[pos : pos + k]) in members)
                pos = text.find(prefix, pos + 1)
        frags: list[str | int] = [text] if text else []
        for _, tok_text, tok in sorted(present):
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, str) and tok_text in f:
                    for j, part in enumerate(f.split(tok_text)):
                        out.extend(([tok] if j else []) + ([part] if part else []))
                else:
                    out.append(f)
            frags = out
        return frags

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Ids of `text`. add_special: BOS/EOS as the vocab asks; parse_special: control texts."""
        frags = self._partition(text, parse_special)
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
        if self._sp is None:
            return [self._merge(t) for t in texts]
        if self._suspects and any(s in t for s in self._suspects for t in texts):
            return [self._merge(t) if any(s in t for s in self._suspects) else self._sp.encode(t) for t in texts]
        return self._sp.encode(texts)

    def _merge(self, text: str) -> list[int]:
        """llama.cpp's SPM merge loop on one raw fragment, in pure Python (the fallback)."""
        return spm_merge(text, self._id, self._scores, self._byte)

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
        attr, text = self._attr[tok], self._text[tok]
        if attr & HIDDEN_ATTRS and not special:
            return b""  # also for </s>, user-defined but forced to CONTROL as an EOG token
        if attr & (HIDDEN_ATTRS | A_USER_DEFINED):
            return text.encode()
        if attr & A_NORMAL:
            return text.replace(SPM_SPACE, " ").encode()
        if attr & A_BYTE:
            return bytes([int(text[3:5], 16)])
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


_Groups = dict[str, tuple[dict[str, tuple[int, str, int]], list[int]]]


def _group(ids: list[int], text: list[str]) -> _Groups:
    """Specials as (rank in partition order, text, id), grouped by their first 3 characters."""
    groups: _Groups = {}
    for rank, i in enumerate(ids):
        members, lengths = groups.setdefault(text[i][:3], ({}, []))
        members[text[i]] = (rank, text[i], i)
        if len(text[i]) not in lengths:
            lengths.append(len(text[i]))
    return groups
