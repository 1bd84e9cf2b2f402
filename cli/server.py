"""`ubatch server`: llama-server's flags and defaults, checked and turned into settings.

This module is the command line only: the options (grouped as llama-server's help groups
them), the checks that must fail before anything loads, and the server-wide settings. Binding,
loading the model and running uvicorn are in cli/server_run.py; the HTTP layer is
cli/server_app.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from . import validate
from .common import backend_option, read_text_file, user_errors

MODEL, SERVER, CTX, BATCH, SAMPLING = "Model", "Server", "Context", "Batching", "Sampling"


@user_errors
def server(
    model: Optional[Path] = typer.Option(
        None, "-m", "--model", help="GGUF file (default: Gemma 3 270M Q4_K_M, bundled)", rich_help_panel=MODEL
    ),
    alias: Optional[str] = typer.Option(
        None, "-a", "--alias", help="model name in responses and /v1/models", rich_help_panel=MODEL
    ),
    chat_template: Optional[str] = typer.Option(
        None,
        "--chat-template",
        help="chat template: gemma, chatml, llama3, a Jinja file or inline Jinja (default: the model's)",
        rich_help_panel=MODEL,
    ),
    jinja: bool = typer.Option(
        True,
        "--jinja/--no-jinja",
        help="render the model's Jinja template (--no-jinja: its built-in format)",
        rich_help_panel=MODEL,
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on", rich_help_panel=SERVER),
    port: int = typer.Option(8080, "--port", help="port to listen on (0 = any free port)", rich_help_panel=SERVER),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        envvar="LLAMA_API_KEY",
        help="API key(s), comma-separated; required on every route but /health and /models",
        rich_help_panel=SERVER,
    ),
    api_key_file: Optional[Path] = typer.Option(
        None, "--api-key-file", help="file with one API key per line", rich_help_panel=SERVER
    ),
    timeout: int = typer.Option(
        600, "-to", "--timeout", help="idle keep-alive timeout in seconds", rich_help_panel=SERVER
    ),
    metrics: bool = typer.Option(
        False, "--metrics", help="enable the Prometheus /metrics endpoint", rich_help_panel=SERVER
    ),
    slots: bool = typer.Option(True, "--slots/--no-slots", help="expose the /slots endpoint", rich_help_panel=SERVER),
    log_disable: bool = typer.Option(
        False, "--log-disable", help="no startup log and no per-request lines", rich_help_panel=SERVER
    ),
    log_verbosity: int = typer.Option(
        3,
        "-lv",
        "--verbosity",
        "--log-verbosity",
        envvar="LLAMA_LOG_VERBOSITY",
        help="log threshold, llama.cpp's levels (4 = debug: a line per request); failures always logged",
        rich_help_panel=SERVER,
    ),
    n_parallel: int = typer.Option(
        -1,
        "-np",
        "--parallel",
        help="number of slots (-1 = auto: 4 slots with a unified KV cache)",
        rich_help_panel=CTX,
    ),
    ctx_size: int = typer.Option(
        0,
        "-c",
        "--ctx-size",
        help="context size, split across the slots unless -kvu (0 = from the model)",
        rich_help_panel=CTX,
    ),
    kv_unified: bool = typer.Option(
        False, "-kvu", "--kv-unified", help="one KV cache shared by all slots", rich_help_panel=CTX
    ),
    no_kv_unified: bool = typer.Option(
        False, "-no-kvu", "--no-kv-unified", help="one KV stream per slot (ignored with -np -1)", rich_help_panel=CTX
    ),
    ctk: str = typer.Option(
        "f16", "-ctk", "--cache-type-k", help="KV cache type for K (f32, f16, bf16, q8_0, q4_0)", rich_help_panel=CTX
    ),
    ctv: str = typer.Option("f16", "-ctv", "--cache-type-v", help="KV cache type for V", rich_help_panel=CTX),
    swa_full: bool = typer.Option(
        False, "--swa-full", help="full-size SWA cache (allows context shift on gemma3)", rich_help_panel=CTX
    ),
    context_shift: bool = typer.Option(
        False,
        "--context-shift/--no-context-shift",
        help="when a slot's context fills, drop half of it and continue",
        rich_help_panel=CTX,
    ),
    cache_reuse: int = typer.Option(
        0, "--cache-reuse", help="min chunk size to reuse from the cache via KV shifting (0 = off)", rich_help_panel=CTX
    ),
    cache_prompt: bool = typer.Option(
        True,
        "--cache-prompt/--no-cache-prompt",
        help="reuse the slot's common prefix with the previous request",
        rich_help_panel=CTX,
    ),
    slot_prompt_similarity: float = typer.Option(
        0.1,
        "-sps",
        "--slot-prompt-similarity",
        help="pick the idle slot whose cache matches this much of the prompt",
        rich_help_panel=CTX,
    ),
    batch_size: int = typer.Option(
        2048, "-b", "--batch-size", help="logical batch size: rows per decode call", rich_help_panel=BATCH
    ),
    ubatch_size: int = typer.Option(
        512, "-ub", "--ubatch-size", help="physical batch size: rows per forward pass", rich_help_panel=BATCH
    ),
    cont_batching: bool = typer.Option(
        True,
        "-cb/-nocb",
        "--cont-batching/--no-cont-batching",
        help="mix prompt chunks into generation batches",
        rich_help_panel=BATCH,
    ),
    threads: int = typer.Option(-1, "-t", "--threads", help="CPU threads (-1 = all)", rich_help_panel=BATCH),
    backend: str = backend_option(BATCH),
    no_warmup: bool = typer.Option(False, "--no-warmup", rich_help_panel=BATCH),
    n_predict: int = typer.Option(
        -1,
        "-n",
        "--n-predict",
        help="default tokens to generate per request (-1 = unlimited)",
        rich_help_panel=SAMPLING,
    ),
    temp: float = typer.Option(0.8, "--temp", rich_help_panel=SAMPLING),
    top_k: int = typer.Option(40, "--top-k", rich_help_panel=SAMPLING),
    top_p: float = typer.Option(0.95, "--top-p", rich_help_panel=SAMPLING),
    min_p: float = typer.Option(0.05, "--min-p", rich_help_panel=SAMPLING),
    seed: int = typer.Option(-1, "-s", "--seed", help="default RNG seed (-1 = random)", rich_help_panel=SAMPLING),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", rich_help_panel=SAMPLING),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", rich_help_panel=SAMPLING),
) -> None:
    validate.in_range("--port", port, "port", 0, 65535)
    validate.positive("-to", timeout, "timeout")
    validate.context_flags(ctx_size, batch_size, ubatch_size, threads)
    validate.at_least("--cache-reuse", cache_reuse, "n_cache_reuse", 1, sentinel=(0, "off"))
    validate.fraction("-sps", slot_prompt_similarity, "slot_prompt_similarity")
    validate.generation_flags(n_predict)
    validate.sampling_flags(temp, top_k, top_p, min_p, seed, repeat_penalty, repeat_last_n)
    validate.n_parallel(n_parallel, auto=True)  # these three import the engine's tables: last
    validate.kv_types(ctk, ctv)
    validate.backend(backend)
    if n_parallel < 0:  # llama-server's auto: 4 slots and a unified KV cache, whatever -no-kvu says
        n_parallel, kv_unified = 4, True
    elif no_kv_unified:
        kv_unified = False
    if chat_template is not None:  # fail before loading anything
        from ..engine.chat_template import load_template

        load_template(chat_template)
    keys = [k.strip() for k in (api_key or "").split(",") if k.strip()]
    if api_key_file is not None:
        keys += [k.strip() for k in read_text_file(api_key_file, "API key file").splitlines() if k.strip()]

    from ..engine.sampling import LLAMA_DEFAULT_SEED, SamplerParams
    from .server_app import ServerOptions
    from .server_run import load_scheduler, serve

    options = ServerOptions(
        api_keys=tuple(keys),
        metrics=metrics,
        slots=slots,
        alias=alias,
        chat_template=chat_template,
        jinja=jinja,
        n_predict=n_predict,
        cache_prompt=cache_prompt,
        sampling=SamplerParams(
            temp=max(temp, 0.0),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=LLAMA_DEFAULT_SEED if seed < 0 else seed,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
        ),
    )

    def load() -> Any:
        return load_scheduler(
            model,
            n_parallel,
            ctx_size,
            batch_size,
            ubatch_size,
            kv_unified,
            ctk,
            ctv,
            swa_full,
            threads,
            no_warmup,
            context_shift,
            cache_reuse,
            slot_prompt_similarity,
            cont_batching,
            log_disable,
            backend,
        )

    serve(host, port, options, load, timeout=timeout, log_disable=log_disable, log_verbosity=log_verbosity)
