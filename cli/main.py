"""`ubatch`: llama.cpp's tools, re-implemented so that they explain their memory and speed."""

from __future__ import annotations

import typer

from . import complete, info, tokenize

app = typer.Typer(
    name="ubatch",
    help="A llama.cpp-style runner that shows its work: -c -b -ub -np, KV cache and compute buffer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("cli", help="One-shot completion (like llama-completion -no-cnv).")(complete.cli)
app.command("tokenize", help="Tokenize text like llama-tokenize.")(tokenize.tokenize)
app.command("info", help="The memory plan of a configuration (KV cache, compute buffer, why).")(info.info)

if __name__ == "__main__":
    app()
