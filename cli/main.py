"""`ubatch`: llama.cpp's tools, re-implemented so that they explain their memory and speed."""

from __future__ import annotations

import typer

from ubatch.cli import convert, info, tokenize
from ubatch.cli.bench import command as bench
from ubatch.cli.complete import command as complete
from ubatch.cli.explain import command as explain
from ubatch.cli.llama.command import LlamaGroup, llama_command
from ubatch.cli.server import command as server

app = typer.Typer(
    name="ubatch",
    help="A llama.cpp-style runner that shows its work: -c -b -ub -np, KV cache and compute buffer.",
    cls=LlamaGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
HELP = {
    "cli": "Chat in the terminal (no -p, or -cnv / -sys / -st), or with -p a one-shot completion (like llama-completion).",
    "server": "OpenAI- and llama-server-compatible HTTP server: -np slots, continuous batching.",
    "bench": "Benchmark like llama-bench: pp/tg t/s, compute buffer, --profile, --sweep-ub plots.",
    "batched-bench": "Continuous-batching throughput like llama-batched-bench.",
    "info": "The memory plan of a configuration (KV cache, compute buffer, why).",
    "explain": "Run a request and show how it was batched, split, padded and masked, and where the memory went.",
    "tokenize": "Tokenize text like llama-tokenize.",
    "convert": "Write a Hugging Face checkpoint directory as a GGUF file (--outtype f16, bf16, q8_0).",
}
# each command, and the llama.cpp tool whose other spellings and LLAMA_ARG_* it takes (cli/llama)
COMMANDS = (
    ("cli", complete.cli, "cli"),
    ("server", server.server, "server"),
    ("bench", bench.bench, "bench"),
    ("batched-bench", bench.batched_bench, "batched-bench"),
    ("info", info.info, "info"),
    ("explain", explain.explain, "cli"),
    ("tokenize", tokenize.tokenize, "tokenize"),
    ("convert", convert.convert, None),
)
for name, fn, tool in COMMANDS:
    app.command(name, cls=llama_command(tool) if tool else None, help=HELP[name])(fn)

if __name__ == "__main__":
    app()
