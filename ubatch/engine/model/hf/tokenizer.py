"""A checkpoint's `tokenizer.model` turned into the tokenizer.ggml.* keys, as llama.cpp's converter does.

The SentencePiece model is read with the `sentencepiece` library; each piece gets its text, score
and token type, ids past the model's pieces are `[PAD{i}]` placeholders, `added_tokens.json` and
`tokenizer_config.json`'s `added_tokens_decoder` override pieces, and `gguf.SpecialVocab` reads
the special ids, add_bos/add_eos and the chat template. The engine's Vocab then reads these keys
exactly as it reads a GGUF file's, so one tokenizer runs for both.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gguf
from gguf import TokenType

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.model.archs import ARCHS


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
    if not f.is_file():
        raise ModelLoadError(
            f"{d}: no tokenizer.model; ubatch reads SentencePiece tokenizers only (tokenizer.json alone is not supported)"
        )
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


def write_tokenizer(w: gguf.GGUFWriter, d: Path, arch: str, vocab_size: int | None) -> int:
    """The tokenizer keys into w; returns the number of tokens."""
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
    log = logging.getLogger("gguf.vocab")
    level, log.level = log.level, logging.ERROR  # its per-key info/warnings are not ours to print
    try:
        gguf.SpecialVocab(d, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    finally:
        log.setLevel(level)
    if space_prefix == "never":
        w.add_add_space_prefix(False)
    return len(tokens)
