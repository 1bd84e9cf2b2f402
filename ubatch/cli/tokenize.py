"""`ubatch tokenize`: llama-tokenize's output formats, plus --jsonl for many strings per load."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ubatch.cli.common import check_text, read_text_file, resolve_model, user_errors
from ubatch.cli.options import opt
from ubatch.engine.errors import UbatchError


@user_errors
def tokenize(
    model: Optional[Path] = opt("model", None, panel="Options"),
    prompt: Optional[str] = opt("prompt", None, help="text to tokenize", panel="Options"),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="read the text from a file"),
    stdin: bool = typer.Option(False, "--stdin", help="read the text from standard input"),
    ids: bool = typer.Option(False, "--ids", help="print only the ids, as a Python list"),
    no_bos: bool = typer.Option(False, "--no-bos", help="do not add BOS"),
    no_parse_special: bool = typer.Option(False, "--no-parse-special", help="treat control-token text as plain text"),
    show_count: bool = typer.Option(False, "--show-count", help="print the number of tokens"),
    jsonl: bool = typer.Option(
        False, "--jsonl", help="read one JSON string per stdin line, write one JSON id list per line"
    ),
) -> None:
    from ubatch.engine.model.hf.checkpoint import open_model_file  # here: --help never loads the GGUF reader
    from ubatch.engine.vocab.vocab import Vocab

    g = open_model_file(resolve_model(model))
    vocab = Vocab.from_metadata(g.metadata, str(g.path))
    for w in vocab.warnings:  # as llama-tokenize's log shows them, on stderr
        sys.stderr.write(f"load: {w}\n")
    add_special, parse_special = not no_bos, not no_parse_special
    if jsonl:
        for n, line in enumerate(sys.stdin, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)
            except json.JSONDecodeError as e:
                raise UbatchError(f"stdin line {n}: not valid JSON ({e.msg}); give one JSON string per line") from None
            if not isinstance(text, str):
                raise UbatchError(f"stdin line {n}: expected a JSON string, got {type(text).__name__}")
            check_text(text, f"stdin line {n}")
            sys.stdout.write(json.dumps(vocab.tokenize(text, add_special, parse_special)) + "\n")
        sys.stdout.flush()
        return
    # Bytes that are not UTF-8 reach the tokenizer as surrogate escapes (Python decodes argv so),
    # which it tokenizes as llama-tokenize does the raw bytes.
    if prompt is None and file is not None:
        prompt = read_text_file(file, "input file", errors="surrogateescape")
    if prompt is None and stdin:
        prompt = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    if prompt is None:
        raise UbatchError("nothing to tokenize: give -p TEXT, -f FILE, --stdin or --jsonl")
    toks = vocab.tokenize(prompt, add_special, parse_special)
    if ids:
        print("[" + ", ".join(map(str, toks)) + "]")
    else:
        for t in toks:
            piece = vocab.token_to_piece(t, special=True).decode("utf-8", errors="replace")
            print(f"{t:6d} -> '{piece}'")
    if show_count:
        print(f"Total number of tokens: {len(toks)}")
