"""The SentencePiece model a GGUF 'llama' vocabulary tokenizes with, as serialised protobuf.

A BPE ModelProto with an identity normalizer and byte fallback, whose merge loop is llama.cpp's
SPM one. The 262,144 pieces of a Gemma vocabulary are written in protobuf's wire format
directly: building them as message objects costs ~30 MB of heap that is never given back.
"""

from __future__ import annotations

import numpy as np

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


def bpe_model_proto(texts: list[str], scores: np.ndarray, kinds: list[int], unk: int) -> bytes:
    """ModelProto bytes: pieces (text, score, SentencePiece type) plus the trainer and normalizer
    specs (BPE, byte fallback, identity normalization, no dummy prefix)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.vocab_size = len(texts)
    m.trainer_spec.unk_id = unk
    m.trainer_spec.bos_id = m.trainer_spec.eos_id = m.trainer_spec.pad_id = -1
    ns = m.normalizer_spec  # identity: no NFKC, no whitespace clean-up, no dummy prefix
    ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces = "identity", False, False
    ns.escape_whitespaces = True
    pieces = bytearray()
    score_bytes = np.asarray(scores, "<f4").tobytes()
    for i, (text, kind) in enumerate(zip(texts, kinds)):
        b = text.encode("utf-8")
        body = b"\x0a" + _varint(len(b)) + b + b"\x15" + score_bytes[4 * i : 4 * i + 4] + b"\x18" + _varint(kind)
        pieces += b"\x0a" + _varint(len(body)) + body  # ModelProto.pieces (field 1)
    return bytes(pieces) + m.SerializeToString()
