"""The constants of llama.cpp's vocabularies: GGUF token types and attribute bits, the special
token texts llama.cpp recognises at load time, and the tokenizer models ubatch does not run."""

from __future__ import annotations

# GGUF token types (llama_token_type = SentencePiece's enum) and llama.cpp's attribute bits.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
A_UNKNOWN, A_UNUSED, A_NORMAL, A_CONTROL, A_USER_DEFINED, A_BYTE = 1, 2, 4, 8, 16, 32
A_LSTRIP, A_RSTRIP = 1 << 7, 1 << 8  # set by model name at load: whitespace before / after is dropped
TYPE_ATTR = {
    NORMAL: A_NORMAL,
    UNKNOWN: A_UNKNOWN,
    CONTROL: A_CONTROL,
    USER_DEFINED: A_USER_DEFINED,
    UNUSED: A_UNUSED,
    BYTE: A_BYTE,
}
HIDDEN_ATTRS = A_CONTROL | A_UNKNOWN  # not parsed without parse_special, not printed without special

# llama.cpp's load-time auto-detection by text: when the id key is absent, a token with one of
# these texts becomes that special token (and is forced to CONTROL).
AUTO_SPECIAL_TEXTS = {
    "eot": (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "<｜end▁of▁sentence｜>",
        "<end_of_utterance>",
    ),
    "eom": ("<|eom_id|>",),
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Every token with one of these texts ends generation (and is forced to CONTROL).
EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)
UNSUPPORTED_MODELS = {"t5": "Unigram", "rwkv": "RWKV", "plamo2": "PLaMo2", "hybriddna": "BPE with DNA k-mers"}
SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space
BYTE_TEXTS = [f"<0x{b:02X}>" for b in range(256)]
