"""The SentencePiece model a GGUF 'llama' vocabulary tokenizes with, as serialised protobuf.

A BPE ModelProto with an identity normalizer and byte fallback, whose merge loop is llama.cpp's
SPM one. The 262,144 pieces of a Gemma vocabulary are written in protobuf's wire format
directly: building them as message objects costs ~30 MB of heap that is never given back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.vocab.tables import BYTE as _BYTE
from ubatch.engine.vocab.tables import NORMAL as _NORMAL
from ubatch.engine.vocab.tables import UNKNOWN as _UNKNOWN

if TYPE_CHECKING:
    from sentencepiece import SentencePieceProcessor

_SMALL = [bytes((i,)) for i in range(0x80)]


def _varint(n: int) -> bytes:
    """Protobuf's base-128 varint."""
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pieces(texts: StringArray, scores: np.ndarray, kinds: np.ndarray) -> bytes:
    """ModelProto.pieces (field 1) for every token, in wire format. Each entry is
    0a <len> [0a <len> text] [15 score] [18 kind]; with texts under 117 bytes every length is one
    byte, so the entries are laid out with numpy in one pass; longer texts take the loop."""
    lens = texts.lengths()
    score_bytes = np.asarray(scores, "<f4").view(np.uint8).reshape(-1, 4)
    if len(lens) and (lens.max() > 116 or kinds.max() > 0x7F):
        entries = bytearray()
        for i, (a, b) in enumerate(texts.spans()):
            t = texts.blob[a:b]
            body = b"\x0a" + _varint(len(t)) + t + b"\x15" + score_bytes[i].tobytes() + b"\x18" + _varint(int(kinds[i]))
            entries += b"\x0a" + _varint(len(body)) + body
        return bytes(entries)
    start = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens + 11, out=start[1:])
    out = np.empty(int(start[-1]), np.uint8)
    head, tail = start[:-1], start[:-1] + 4 + lens
    text_at = np.ones(len(out), bool)
    # the bytes around each text: entry tag and length, text tag and length; score, kind
    before: tuple[int | np.ndarray, ...] = (0x0A, lens + 9, 0x0A, lens)
    after: tuple[int | np.ndarray, ...] = (0x15, *score_bytes.T, 0x18, kinds)
    for k, v in enumerate(before):
        out[head + k] = v
        text_at[head + k] = False
    for k, v in enumerate(after):
        out[tail + k] = v
        text_at[tail + k] = False
    out[text_at] = np.frombuffer(texts.blob, np.uint8)
    return out.tobytes()


def bpe_model_proto(texts: StringArray, scores: np.ndarray, kinds: np.ndarray, unk: int) -> bytes:
    """ModelProto bytes: pieces (text, score, SentencePiece type) plus the trainer and normalizer
    specs (BPE, byte fallback, identity normalization, no dummy prefix)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()  # type: ignore[attr-defined]  # protobuf makes its message classes at import time
    m.trainer_spec.model_type = m.trainer_spec.BPE  # TrainerSpec.ModelType.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.vocab_size = len(texts)
    m.trainer_spec.unk_id = unk
    m.trainer_spec.bos_id = m.trainer_spec.eos_id = m.trainer_spec.pad_id = -1
    ns = m.normalizer_spec  # identity: no NFKC, no whitespace clean-up, no dummy prefix
    ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces = "identity", False, False
    ns.escape_whitespaces = True
    return _pieces(texts, scores, kinds) + m.SerializeToString()


def sentencepiece_for(
    texts: StringArray, scores: np.ndarray, unk: int, byte_ids: list[int]
) -> SentencePieceProcessor | None:
    """A processor whose merge loop is llama.cpp's: every piece NORMAL but the unknown and byte
    pieces; None if sentencepiece refuses the vocabulary."""
    import sentencepiece as spm

    kinds = np.full(len(texts), _NORMAL, np.uint8)
    kinds[byte_ids] = _BYTE
    kinds[unk] = _UNKNOWN
    try:
        return spm.SentencePieceProcessor(model_proto=bpe_model_proto(texts, scores, kinds, unk))
    except RuntimeError:
        return None
