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
app.command(
    "cli",
    cls=llama_command("cli"),
    help="Chat in the terminal (no -p, or -cnv / -sys / -st), or with -p a one-shot completion (like llama-completion).",
)(complete.cli)
app.command(
    "server",
    cls=llama_command("server"),
    help="OpenAI- and llama-server-compatible HTTP server: -np slots, continuous batching.",
)(server.server)
app.command(
    "bench",
    cls=llama_command("bench"),
    help="Benchmark like llama-bench: pp/tg t/s, compute buffer, --profile, --sweep-ub plots.",
)(bench.bench)
app.command(
    "batched-bench", cls=llama_command("batched-bench"), help="Continuous-batching throughput like llama-batched-bench."
)(bench.batched_bench)
app.command(
    "info", cls=llama_command("info"), help="The memory plan of a configuration (KV cache, compute buffer, why)."
)(info.info)
app.command(
    "explain",
    cls=llama_command("cli"),
    help="Run a request and show how it was batched, split, padded and masked, and where the memory went.",
)(explain.explain)
app.command("tokenize", cls=llama_command("tokenize"), help="Tokenize text like llama-tokenize.")(tokenize.tokenize)
app.command("convert", help="Write a Hugging Face checkpoint directory as a GGUF file (--outtype f16, bf16, q8_0).")(
    convert.convert
)

if __name__ == "__main__":
    app()
