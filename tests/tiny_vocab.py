"""A tiny SentencePiece-style vocabulary laid out like Gemma's, for tokenizer tests and tiny models.

Ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <start_of_turn> 4, <end_of_turn> 5, "\\n" 6 (user-defined),
the 256 byte tokens <0x00>..<0xFF> at BYTE0 + byte, then normal pieces. Normal scores are minus
the rank, as in Gemma, so earlier pieces in MERGED win merges.
"""

from __future__ import annotations

PAD, EOS, BOS, UNK, START_OF_TURN, END_OF_TURN, NEWLINE = range(7)
BYTE0 = 7
# GGUF token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

SPECIALS = [
    ("<pad>", CONTROL),
    ("<eos>", CONTROL),
    ("<bos>", CONTROL),
    ("<unk>", UNKNOWN),
    ("<start_of_turn>", CONTROL),
    ("<end_of_turn>", CONTROL),
    ("\n", USER_DEFINED),
]
# Multi-character pieces, best first: "▁the" needs "▁t" + "he"; "▁world" needs "▁wor" + "ld".
MERGED = ["▁t", "he", "▁the", "▁a", "in", "er", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁h", "▁he", "llo", "▁hello"]
SINGLE = ["▁", *"abcdefghijklmnopqrstuvwxyz", *".,!?'-_<>/0123456789"]


def tiny_spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the tiny vocabulary (326 tokens)."""
    tokens = [t for t, _ in SPECIALS] + [f"<0x{b:02X}>" for b in range(256)] + MERGED + SINGLE
    types = [k for _, k in SPECIALS] + [BYTE] * 256 + [NORMAL] * (len(MERGED) + len(SINGLE))
    n_fixed = len(SPECIALS) + 256
    scores = [-1000.0] * len(SPECIALS) + [0.0] * 256
    scores += [-float(rank) for rank in range(len(tokens) - n_fixed)]
    return tokens, scores, types


def piece_id(piece: str) -> int:
    """Id of a piece of the tiny vocabulary (for readable expected values in tests)."""
    return tiny_spm_vocab()[0].index(piece)


def add_spm_vocab(w, tokens: list[str], scores: list[float], types: list[int]) -> None:
    """The SPM tokenizer keys every test GGUF carries (BOS 2, EOS 1), on a gguf.GGUFWriter."""
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
