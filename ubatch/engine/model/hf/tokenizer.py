"""A checkpoint's tokenizer turned into the tokenizer.ggml.* keys, as llama.cpp's converter does.

`tokenizer.model` (SentencePiece: Llama 2, Mistral, Gemma, Phi-3) is read with the `sentencepiece`
library; each piece gets its text, score and token type, ids past the model's pieces are
`[PAD{i}]` placeholders, `added_tokens.json` and `tokenizer_config.json`'s `added_tokens_decoder`
override pieces. Without one, `tokenizer.json` (byte-level BPE: Llama 3, Qwen, OLMo 2, SmolLM3,
Granite) is read with Hugging Face's `tokenizers` library, as the converter reads it through
transformers: the vocabulary by id, added tokens as control or user-defined, and the
pre-tokenizer named by the hash of the ids the tokenizer gives for the converter's check text
(`bpe_pre.py`). Either way `gguf.SpecialVocab` reads the special ids, add_bos/add_eos, the merges
and the chat template. The engine's Vocab then reads these keys exactly as it reads a GGUF
file's, so one tokenizer runs for both.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import gguf
from gguf import TokenType

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.model.archs import ARCHS
from ubatch.engine.model.hf.bpe_pre import CHKTXT, PRE_BY_HASH


def _looks_special(token: str) -> bool:
    """The converter's test for added tokens that are control tokens even when not marked special."""
    if (token.startswith("<|") and token.endswith("|>")) or (token.startswith("<") and token.endswith(">")):
        return True
    return token.startswith("<｜") and token.endswith("｜>")


def _json(f: Path) -> Any:
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{f}: not valid JSON ({e})") from None


def spm_tables(d: Path, vocab_size: int | None) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, token types) for ids 0 .. vocab_size-1 (the config's, else the model's)."""
    from sentencepiece import SentencePieceProcessor

    f = d / "tokenizer.model"
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(f))
    except (OSError, RuntimeError) as e:
        raise ModelLoadError(f"{f}: not a SentencePiece model ({str(e).splitlines()[0] if str(e) else e})") from None
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = [-10000.0] * n
    types = [int(TokenType.UNUSED)] * n
    for i in range(min(n, sp.vocab_size())):
        t = TokenType.NORMAL
        if sp.IsUnknown(i):
            t = TokenType.UNKNOWN
        elif sp.IsControl(i):
            t = TokenType.CONTROL
        elif sp.IsUnused(i):
            t = TokenType.UNUSED
        elif sp.IsByte(i):
            t = TokenType.BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i), sp.GetScore(i), int(t)
    added = d / "added_tokens.json"
    if added.is_file():
        for text, i in _json(added).items():
            if isinstance(i, int) and 0 <= i < n:
                tokens[i], scores[i], types[i] = text, -1000.0, int(TokenType.USER_DEFINED)
    tc = d / "tokenizer_config.json"
    decoder = _json(tc).get("added_tokens_decoder", {}) if tc.is_file() else {}
    for key, tok in (decoder or {}).items():
        i, text = int(key), tok["content"]
        if not 0 <= i < n:
            continue
        if tok.get("special") or _looks_special(text):
            types[i] = int(TokenType.CONTROL)
        else:
            text = text.replace("\u2581", " ")
            types[i] = int(TokenType.USER_DEFINED)
        tokens[i], scores[i] = text, -1000.0
    return tokens, scores, types


def bpe_tables(d: Path, vocab_size: int | None) -> tuple[list[str], list[int], str]:
    """(tokens, token types, pre-tokenizer name) of tokenizer.json's byte-level BPE for ids
    0 .. vocab_size-1 (the config's, else the tokenizer's), as the converter's get_vocab_base."""
    from tokenizers import Tokenizer

    f = d / "tokenizer.json"
    try:  # parsed once, by the library (a tokenizer.json is often 10 MB)
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # the library raises its own exception types
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"{f}: not valid JSON or not a tokenizer the tokenizers library reads ({why})") from None
    kind = type(tok.model).__name__
    if kind != "BPE":
        raise ModelLoadError(f"{f}: a {kind} tokenizer without tokenizer.model; ubatch reads BPE tokenizer.json only")
    vocab = tok.get_vocab(with_added_tokens=True)
    n = vocab_size or len(vocab)
    if vocab and max(vocab.values()) >= n:
        raise ModelLoadError(f"{f}: token id {max(vocab.values())} is past config.json's vocab_size = {n}")
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
            continue
        text = reverse[i]
        if i in added:
            a = added[i]
            if not a.normalized:  # the converter's encode-then-decode, which gives such a token back as written
                text = tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
            if a.special or _looks_special(text):
                types.append(int(TokenType.CONTROL))
            else:
                text = text.replace("\u2581", " ")
                types.append(int(TokenType.USER_DEFINED))
        else:
            types.append(int(TokenType.NORMAL))
        tokens.append(text)
    chkhsh = hashlib.sha256(str(tok.encode(CHKTXT).ids).encode()).hexdigest()
    pre = PRE_BY_HASH.get(chkhsh)
    if pre is None:
        raise ModelLoadError(
            f"{f}: its BPE pre-tokenizer is not one llama.cpp knows (check hash {chkhsh[:16]}...), as llama.cpp's "
            "converter would say; use a GGUF file converted with a llama.cpp that supports it"
        )
    return tokens, types, pre


def write_tokenizer(w: gguf.GGUFWriter, d: Path, arch: str, vocab_size: int | None) -> int:
    """The tokenizer keys into w; returns the number of tokens."""
    if not (d / "tokenizer.model").is_file():
        if not (d / "tokenizer.json").is_file():
            raise ModelLoadError(f"{d}: neither tokenizer.model nor tokenizer.json; the directory has no tokenizer")
        tokens, types, pre = bpe_tables(d, vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        _special_vocab(w, d, len(tokens), merges=True)
        return len(tokens)
    tokens, scores, types = spm_tables(d, vocab_size)
    space_prefix = ARCHS[arch].hf.space_prefix
    if space_prefix == "config":
        tc = d / "tokenizer_config.json"
        prefix = _json(tc).get("add_prefix_space") if tc.is_file() else None
        if prefix is not None:
            w.add_add_space_prefix(bool(prefix))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    _special_vocab(w, d, len(tokens), merges=False)
    if space_prefix == "never":
        w.add_add_space_prefix(False)
    return len(tokens)


def _special_vocab(w: gguf.GGUFWriter, d: Path, n_vocab: int, merges: bool) -> None:
    """Special ids, add_bos/add_eos, the chat template (and BPE's merges) as gguf's SpecialVocab reads them."""
    log = logging.getLogger("gguf.vocab")
    level, log.level = log.level, logging.ERROR  # its per-key info/warnings are not ours to print
    try:
        gguf.SpecialVocab(d, load_merges=merges, n_vocab=n_vocab).add_to_gguf(w, quiet=True)
    finally:
        log.setLevel(level)
