"""The options the commands share, declared once: names, help and panel in `OPTIONS`, the sampling
flags as one group (cli/sampling_flags.py). A command writes `ctx_size: int = opt("ctx_size", 0)`;
the default may differ per command (llama-server's -np is -1, llama-cli's 1), the flag does not.
llama.cpp's other spellings and LLAMA_ARG_* variables are added by cli/llama/command.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import typer

P = TypeVar("P")

MODEL, CTX, BATCH, SAMPLING, OUTPUT, SERVER, CHAT = (
    "Model",
    "Context",
    "Batching",
    "Sampling",
    "Output",
    "Server",
    "Conversation",
)
PROMPT_CACHE = "Prompt cache"
# --help's panels in the order a user reads them: what runs, how it samples, how big, then the
# rest (a command's own panels: server, speculative decoding, prompt cache, ...). See `reading_order`.
PANEL_ORDER = (MODEL, SAMPLING, CTX, BATCH, CHAT, OUTPUT)
BACKEND_HELP = "op backend: auto (the C kernels on the GGUF blocks; torch if they cannot be built), cpu, cpu-avx2 (256-bit kernels on an AVX-512 CPU), cpu-noamx (f32 GEMM where cpu uses AMX tiles), cpu-portable, torch (dense f32 reference)"
KV_TYPES_HELP = "(f32, f16, bf16, q8_0, q4_0)"


@dataclass(frozen=True, slots=True)
class Spec:
    names: tuple[str, ...]
    help: str
    panel: str


OPTIONS: dict[str, Spec] = {
    "model": Spec(("-m", "--model"), "GGUF file (default: Gemma 3 270M Q4_K_M, bundled)", MODEL),
    "prompt": Spec(("-p", "--prompt"), "prompt text", MODEL),
    "file": Spec(("-f", "--file"), "read the prompt from a file", MODEL),
    "n_predict": Spec(("-n", "--n-predict"), "tokens to generate (-1 = until end of generation)", SAMPLING),
    "ctx_size": Spec(("-c", "--ctx-size"), "context size (0 = from the model)", CTX),
    "ctk": Spec(("-ctk", "--cache-type-k"), f"KV cache type for K {KV_TYPES_HELP}", CTX),
    "ctv": Spec(("-ctv", "--cache-type-v"), f"KV cache type for V {KV_TYPES_HELP}", CTX),
    "swa_full": Spec(("--swa-full",), "full-size SWA cache (allows context shift on gemma3)", CTX),
    "parallel": Spec(("-np", "--parallel"), "number of sequences (KV streams unless -kvu)", CTX),
    "kv_unified": Spec(("-kvu", "--kv-unified"), "one KV buffer shared by all sequences", CTX),
    "context_shift": Spec(
        ("--context-shift/--no-context-shift",), "when the context is full, drop half of it and go on", CTX
    ),
    "keep": Spec(("--keep",), "tokens of the prompt kept by a context shift (-1 = all)", CTX),
    "batch_size": Spec(("-b", "--batch-size"), "logical batch size (max tokens per decode)", BATCH),
    "ubatch_size": Spec(
        ("-ub", "--ubatch-size"), "physical batch size (max tokens per forward pass; 0 = n_batch)", BATCH
    ),
    "threads": Spec(("-t", "--threads"), "CPU threads (-1 = all)", BATCH),
    "backend": Spec(("--backend",), BACKEND_HELP, BATCH),
    "device": Spec(("-dev", "--device"), "where the model runs: cuda, cpu or auto (cuda when a GPU is visible)", BATCH),
    "n_outputs_max": Spec(("--n-outputs-max",), "output rows the compute buffer is reserved for", BATCH),
    "warmup": Spec(("--warmup/--no-warmup",), "run one empty decode before the first request", BATCH),
    "chat_template": Spec(
        ("--chat-template",),
        "a llama.cpp built-in name (chatml, gemma, llama3, mistral-v7, ...), a Jinja file or inline Jinja (default: the model's)",
        CHAT,
    ),
    "chat_template_file": Spec(("--chat-template-file",), "the chat template from a Jinja file", CHAT),
    "jinja": Spec(("--jinja/--no-jinja",), "render the model's Jinja template (--no-jinja: its built-in format)", CHAT),
    "log_disable": Spec(("--log-disable",), "no startup log or summary", OUTPUT),
    "verbose": Spec(("-v", "--verbose", "--log-verbose"), "more output", OUTPUT),
    "log_verbosity": Spec(("-lv", "--verbosity", "--log-verbosity"), "log threshold, llama.cpp's levels", OUTPUT),
    "special": Spec(("-sp", "--special"), "show special tokens (e.g. <end_of_turn>) in the output", OUTPUT),
}


def opt(name: str, default: Any, help: str | None = None, panel: str | None = None, **extra: Any) -> Any:
    """The typer.Option of a shared flag; `help` and `panel` refine the shared ones for a command."""
    s = OPTIONS[name]
    return typer.Option(default, *s.names, help=help or s.help, rich_help_panel=panel or s.panel, **extra)


def in_panel(panel: str) -> Callable[..., Any]:
    """typer.Option shown under `panel` in --help: for a command's own flags."""
    return functools.partial(typer.Option, rich_help_panel=panel)


def reading_order(params: list[P]) -> list[P]:
    """`params` reordered so that --help prints the shared panels in `PANEL_ORDER`.

    Typer prints panels in the order their first option appears, and a command's options come
    from several places (its own, then the flag groups), so that order is an accident. A panel
    of the command's own that comes before any shared one stays in front (bench's Tests); one
    after goes to the end, in its order (Server, Speculative decoding, Prompt cache). Options
    keep their order within a panel, and parsing does not depend on it.
    """
    rank: dict[str | None, float] = {}
    for p in params:
        panel = getattr(p, "rich_help_panel", None)
        if panel not in rank:
            if panel in PANEL_ORDER:
                rank[panel] = PANEL_ORDER.index(panel)
            else:  # before every shared panel (or no panel: "Options", printed first anyway): in front
                front = panel is None or not any(r >= 0 for r in rank.values())
                rank[panel] = -1 if front else len(PANEL_ORDER)
    return sorted(params, key=lambda p: rank[getattr(p, "rich_help_panel", None)])
