"""A Hugging Face `tokenizer.json` rebuilt from one of llama.cpp's BPE test vocabularies
(models/ggml-vocab-*.gguf in its source): the vocabulary, merges and special tokens of the real
tokenizer with the pre-tokenizer its family's tokenizer.json declares (the regex as llama.cpp
writes it, which splits text the same way). The tokenizers library then tokenizes as the real
tokenizer does, so llama.cpp's converter and ubatch's `-m DIR` reader both see a real Llama 3,
Qwen 2 or GPT-2 tokenizer without a download.
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf import TokenType

from ubatch.engine.gguf.file import open_gguf
from ubatch.engine.vocab.pre_regexes import REGEXES

# family -> (llama.cpp's regex type, BPE ignores merges for whole-word tokens, text BOS is added before)
KINDS: dict[str, tuple[str | None, bool, bool]] = {
    "gpt-2": (None, False, False),  # GPT-2: ByteLevel's own regex
    "llama-bpe": ("LLAMA3", True, True),  # Llama 3: <|begin_of_text|> first
    "qwen2": ("QWEN2", False, False),
}


def vocab_gguf(src: Path, name: str) -> Path:
    return src / "models" / f"ggml-vocab-{name}.gguf"


def write_tokenizer_json(d: Path, src: Path, name: str) -> tuple[list[str], list[int]]:
    """tokenizer.json (and tokenizer_config.json) for family `name` into d; returns the test
    vocabulary's own (tokens, token types), what a conversion must reproduce."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    meta = open_gguf(vocab_gguf(src, name)).metadata
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]  # type: ignore[union-attr]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]  # type: ignore[union-attr]
    merges = [tuple(str(m).split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]  # type: ignore[union-attr]
    regex, ignore_merges, bos = KINDS[name]
    special = [i for i, t in enumerate(types) if t == TokenType.CONTROL]
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (TokenType.NORMAL, TokenType.BYTE)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        split = pre_tokenizers.Split(Regex(REGEXES[regex][0]), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if name == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if bos and isinstance(bos_id, int):
        b = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, bos_id)]
        )
        config |= {"bos_token": b, "add_bos_token": True}
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    if isinstance(eos_id, int):
        config["eos_token"] = tokens[eos_id]
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return tokens, types


def write_qwen2_checkpoint(d: Path, src: Path, chat_template: str | None = None) -> Path:
    """A tiny random Qwen 2 checkpoint (one layer, n_embd 32) whose only tokenizer is Qwen 2's
    tokenizer.json (its 151936 ids), optionally with a chat template in tokenizer_config.json."""
    import torch
    import transformers

    if not (d / "config.json").exists():
        cfg = transformers.Qwen2Config(
            vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=512, bos_token_id=151643, eos_token_id=151645,
            tie_word_embeddings=True,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.Qwen2ForCausalLM(cfg).float().save_pretrained(d, safe_serialization=True)
        write_tokenizer_json(d, src, "qwen2")
        if chat_template is not None:
            tc = json.loads((d / "tokenizer_config.json").read_text())
            (d / "tokenizer_config.json").write_text(json.dumps(tc | {"chat_template": chat_template}))
    return d
