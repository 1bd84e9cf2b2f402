"""`ubatch server`: llama-server's flags and defaults, checked and turned into settings.

This module is the command line only: the options (shared ones from cli/options.py and
cli/sampling_flags.py, the server's own here), the checks that must fail before anything loads,
and the server-wide settings. Binding, loading the model and running uvicorn are in
cli/server/run.py; the HTTP layer is cli/server/app.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from ubatch.cli import validate
from ubatch.cli.common import err_console, process_escapes, read_text_file, user_errors
from ubatch.cli.context_flags import ContextFlags, context_options
from ubatch.cli.flag_group import Refine, refine
from ubatch.cli.lora_flags import LoraFlags, lora_options
from ubatch.cli.options import BATCH, CTX, MODEL, SERVER, opt
from ubatch.cli.parallel_flags import ParallelFlags, parallel_options
from ubatch.cli.sampling_flags import SamplingFlags, sampling_options
from ubatch.cli.server.defaults import (
    DEFAULT_MAX_BODY_SIZE,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_TIMEOUT_S,
    HEADER_TIMEOUT_CAP_S,
)
from ubatch.cli.spec_flags import SpecFlags, spec_options

EMBD = "Embeddings"
REASONING_FORMATS = ("none", "deepseek", "deepseek-legacy", "auto")  # llama.cpp's names


def _flag(default: Any, *names: str, help: str, panel: str = SERVER, **extra: Any) -> Any:
    """A flag of the server's own: its typer.Option, in the Server panel unless said."""
    return typer.Option(default, *names, help=help, rich_help_panel=panel, **extra)


def _csv(v: str | None) -> tuple[str, ...]:
    return tuple(s.strip() for s in (v or "").split(",") if s.strip())


@user_errors
@context_options(
    {
        "parallel": refine(-1, help="number of slots (-1 = auto: 4 slots with a unified KV cache)"),
        "ctx_size": Refine(help="context size, split across the slots unless -kvu (0 = from the model)"),
        "kv_unified": Refine(
            names=("-kvu/-no-kvu", "--kv-unified/--no-kv-unified"),
            help="one KV cache shared by all slots (default with -np -1)",
        ),
        "batch_size": Refine(help="logical batch size: rows per decode call"),
        "ubatch_size": Refine(help="physical batch size: rows per forward pass"),
    }
)
@sampling_options
@spec_options
@parallel_options
@lora_options
def server(
    model: Optional[Path] = opt("model", None),
    alias: Optional[str] = _flag(
        None, "-a", "--alias", help="model name(s), comma-separated: the id and aliases in /v1/models", panel=MODEL
    ),
    tags: Optional[str] = _flag(None, "--tags", help="comma-separated tags listed in /v1/models", panel=MODEL),
    chat_template: Optional[str] = opt("chat_template", None),
    chat_template_file: Optional[Path] = opt("chat_template_file", None),
    jinja: bool = opt("jinja", True),
    prefill_assistant: bool = _flag(
        True, "--prefill-assistant/--no-prefill-assistant", help="continue a final assistant message", panel=MODEL
    ),
    reasoning_format: str = _flag(
        "auto",
        "--reasoning-format",
        help="thinking in chat replies: none (left in content), deepseek or auto (moved to reasoning_content)",
        panel=MODEL,
    ),
    reasoning: str = _flag(
        "auto",
        "-rea",
        "--reasoning",
        help="thinking in chat: on, off (the template's enable_thinking=false) or auto (the template's default)",
        panel=MODEL,
    ),
    reasoning_budget: int = _flag(
        -1,
        "--reasoning-budget",
        help="token budget for thinking: -1 unrestricted, 0 end it at once, N > 0 force its end after N tokens",
        panel=MODEL,
    ),
    reasoning_budget_message: str = _flag(
        "",
        "--reasoning-budget-message",
        help="text written before the forced end-of-thinking tag when the budget runs out",
        panel=MODEL,
    ),
    host: str = _flag("127.0.0.1", "--host", help="addresses to listen on, comma-separated (IPv4, IPv6, *.sock)"),
    port: int = _flag(8080, "--port", help="port to listen on (0 = any free port)"),
    api_prefix: str = _flag("", "--api-prefix", help="prefix every route is also served under"),
    api_key: Optional[str] = _flag(
        None,
        "--api-key",
        envvar="LLAMA_API_KEY",
        help="API key(s), comma-separated; required on every route but /health and the web page",
    ),
    api_key_file: Optional[Path] = _flag(None, "--api-key-file", help="file with one API key per line"),
    cors_origins: str = _flag(
        "localhost",
        "--cors-origins",
        help="allowed origins, comma-separated; 'localhost' reflects only localhost origins; '*' all",
    ),
    cors_methods: str = _flag("GET, POST, DELETE, OPTIONS", "--cors-methods", help="allowed CORS methods"),
    cors_headers: str = _flag("*", "--cors-headers", help="allowed CORS headers"),
    cors_credentials: bool = _flag(
        False, "--cors-credentials/--no-cors-credentials", help="allow credentials for CORS"
    ),
    timeout: int = _flag(
        DEFAULT_TIMEOUT_S,
        "-to",
        "--timeout",
        help=f"read/write timeout in seconds: idle keep-alive, a request body's next chunk (408), "
        f"request headers (at most {HEADER_TIMEOUT_CAP_S} s, then the connection is closed)",
    ),
    max_body_size: int = _flag(
        DEFAULT_MAX_BODY_SIZE,
        "--max-body-size",
        help="largest request body in bytes; a larger one is refused with 413 before it is read",
    ),
    max_json_depth: int = _flag(
        DEFAULT_MAX_JSON_DEPTH,
        "--max-json-depth",
        help="deepest nesting of arrays and objects in a request body; deeper is a 400",
    ),
    metrics: bool = _flag(False, "--metrics", help="enable the Prometheus /metrics endpoint"),
    props: bool = _flag(False, "--props", help="let POST /props change server settings"),
    slots: bool = _flag(True, "--slots/--no-slots", help="expose the /slots endpoint"),
    webui: bool = _flag(
        True, "--webui/--no-webui", help="serve the chat page at / and the engine's live view at /engine"
    ),
    static_path: Optional[Path] = _flag(
        None, "--path", help="serve this folder's files at / instead of the bundled chat page"
    ),
    slot_save_path: Optional[Path] = _flag(
        None, "--slot-save-path", help="directory for POST /slots/{id}?action=save|restore"
    ),
    log_disable: bool = opt("log_disable", False, help="no startup log and no per-request lines", panel=SERVER),
    log_verbosity: int = opt(
        "log_verbosity",
        3,
        envvar="LLAMA_LOG_VERBOSITY",
        help="log threshold, llama.cpp's levels (4 = debug: a line per request)",
        panel=SERVER,
    ),
    embedding: bool = _flag(
        False, "--embedding", "--embeddings", help="serve /embedding and /v1/embeddings", panel=EMBD
    ),
    pooling: Optional[str] = _flag(
        None, "--pooling", help="none, mean, cls, last, rank (default: the model's)", panel=EMBD
    ),
    reranking: bool = _flag(
        False, "--reranking", "--rerank", help="serve /rerank (needs a model with a rank head)", panel=EMBD
    ),
    embd_normalize: int = _flag(
        2, "--embd-normalize", help="embedding normalisation: -1 none, 0 max-abs, 2 Euclidean, p>2 p-norm", panel=EMBD
    ),
    context_shift: bool = opt("context_shift", False, help="when a slot's context fills, drop half of it and continue"),
    keep: int = opt("keep", 0, help="tokens a context shift keeps (-1 = all)"),
    cache_reuse: int = _flag(
        0, "--cache-reuse", help="min chunk size to reuse from the cache via KV shifting (0 = off)", panel=CTX
    ),
    cache_ram: int = _flag(
        8192,
        "-cram",
        "--cache-ram",
        help="MiB of host memory for prompts that leave the KV cache, restored instead of prefilled (0 = off, -1 = no limit)",
        panel=CTX,
    ),
    cache_prompt: bool = _flag(
        True,
        "--cache-prompt/--no-cache-prompt",
        help="reuse the slot's common prefix with the previous request",
        panel=CTX,
    ),
    slot_prompt_similarity: float = _flag(
        0.1,
        "-sps",
        "--slot-prompt-similarity",
        help="pick the idle slot whose cache matches this much of the prompt",
        panel=CTX,
    ),
    cont_batching: bool = _flag(
        True,
        "-cb/-nocb",
        "--cont-batching/--no-cont-batching",
        help="mix prompt chunks into generation batches",
        panel=BATCH,
    ),
    device: str = opt("device", "auto"),
    warmup: bool = opt("warmup", True),
    n_predict: int = opt("n_predict", -1, help="default tokens to generate per request (-1 = unlimited)"),
    reverse_prompt: Optional[list[str]] = _flag(
        None, "-r", "--reverse-prompt", help="default stop string of every request (repeatable)", panel=MODEL
    ),
    special: bool = opt("special", False),
    context: ContextFlags = ContextFlags(),
    sampling: SamplingFlags = SamplingFlags(),
    spec: SpecFlags = SpecFlags(),
    tp: ParallelFlags = ParallelFlags(),
    lora: LoraFlags = LoraFlags(),
) -> None:
    validate.in_range("--port", port, "port", 0, 65535)
    validate.positive("-to", timeout, "timeout")
    validate.positive("--max-body-size", max_body_size, "max_body_size")
    validate.positive("--max-json-depth", max_json_depth, "max_json_depth")
    validate.at_least("--cache-reuse", cache_reuse, "n_cache_reuse", 1, sentinel=(0, "off"))
    validate.at_least("-cram", cache_ram, "cache_ram", 0, sentinel=(-1, "no limit"))
    validate.fraction("-sps", slot_prompt_similarity, "slot_prompt_similarity")
    validate.generation_flags(n_predict, keep)
    validate.choice("--reasoning-format", reasoning_format, "reasoning_format", REASONING_FORMATS)
    reasoning = _on_off_auto("--reasoning", reasoning)
    validate.at_least("--reasoning-budget", reasoning_budget, "reasoning_budget", 0, sentinel=(-1, "unrestricted"))
    if pooling is not None:
        validate.choice("--pooling", pooling, "pooling", ("none", "mean", "cls", "last", "rank"))
    if not _csv(host):
        raise validate.invalid("--host", host, "host", "give at least one address")
    sampling.check()
    lora.check()
    for note in spec.check():
        err_console.print(note, markup=False, soft_wrap=True)
    tp.check()
    context.check(parallel_auto=True)  # last: it imports the engine's tables
    from ubatch.cli.device import resolve_device

    # --device cuda without a GPU: one line, exit 1
    dev, context.backend = resolve_device(device, context.backend)
    tp.follow(dev)
    if context.parallel < 0:  # llama-server's auto: 4 slots and a unified KV cache, whatever -no-kvu says
        context.parallel, context.kv_unified = 4, True
    if chat_template is None and chat_template_file is not None:
        chat_template = str(chat_template_file)
    if chat_template is not None:  # fail before loading anything
        from ubatch.engine.chat.template import load_template

        load_template(chat_template)
    grammar = sampling.compiled_grammar()  # a grammar that does not parse fails before the model loads
    keys = _api_keys(api_key, api_key_file)

    from ubatch.cli.server.run import EngineOptions, load_engine, serve
    from ubatch.cli.server.state import ServerOptions

    names = _csv(alias)
    options = ServerOptions(
        api_keys=tuple(keys),
        metrics=metrics,
        slots=slots,
        slot_save_path=_slot_dir(slot_save_path),
        webui=webui,
        webui_path=_static_dir(static_path),
        aliases=names,  # (the `alias` field is a one-name shorthand for the Python API and tests)
        tags=_csv(tags),
        chat_template=chat_template,
        jinja=jinja,
        n_predict=n_predict,
        cache_prompt=cache_prompt,
        sampling=sampling.sampler_params(),
        embedding=embedding or reranking,
        pooling="rank" if reranking else pooling,
        reranking=reranking,
        cors_origins=cors_origins,
        cors_methods=cors_methods,
        cors_headers=cors_headers,
        cors_credentials=cors_credentials,
        api_prefix=api_prefix.rstrip("/"),
        grammar=grammar,
        props=props,
        prefill_assistant=prefill_assistant,
        embd_normalize=embd_normalize,
        stop=tuple(process_escapes(r) for r in reverse_prompt or []),
        special=special,
        n_keep=keep,
        max_body_size=max_body_size,
        max_json_depth=max_json_depth,
        timeout=timeout,
        reasoning_format=reasoning_format,
        reasoning_budget=reasoning_budget,
        reasoning_budget_message=reasoning_budget_message,
        reasoning=reasoning,
    )
    engine = EngineOptions(
        model=model,
        context=context,
        device=str(dev),
        warmup=warmup,
        context_shift=context_shift,
        cache_reuse=cache_reuse,
        cache_ram=cache_ram,
        slot_prompt_similarity=slot_prompt_similarity,
        cont_batching=cont_batching,
        embedding=embedding,
        pooling=pooling,
        reranking=reranking,
        spec=spec,
        tp=tp,
        lora=lora,
        quiet=log_disable,
    )
    serve(
        host,
        port,
        options,
        lambda: load_engine(engine),
        timeout=timeout,
        log_disable=log_disable,
        log_verbosity=log_verbosity,
    )


def _on_off_auto(flag: str, v: str) -> str:
    """llama.cpp's on|off|auto words (is_truthy / is_falsey / is_autoy) -> "on", "off" or "auto"."""
    w = v.lower()
    for word, spellings in (("on", ("on", "enabled", "true", "1")), ("off", ("off", "disabled", "false", "0"))):
        if w in spellings:
            return word
    if w in ("auto", "-1"):
        return "auto"
    raise validate.invalid(flag, v, "reasoning", "use on, off or auto")


def _api_keys(api_key: str | None, api_key_file: Path | None) -> list[str]:
    """The keys of --api-key (comma-separated) and --api-key-file (one a line, `#` comments, as
    llama-server reads it). A flag given but holding no key is refused: `--api-key " "` or an empty
    file would otherwise serve every route without authentication, the opposite of what was asked."""
    keys = [k.strip() for k in (api_key or "").split(",") if k.strip()]
    if api_key is not None and not keys:
        raise typer.BadParameter(
            "holds no key (only spaces or commas); give a key, or leave the flag out to serve without one",
            param_hint="--api-key",
        )
    if api_key_file is not None:
        lines = read_text_file(api_key_file, "API key file").splitlines()
        found = [k.strip() for k in lines if k.strip() and not k.startswith("#")]
        if not found:
            raise typer.BadParameter(
                f"{api_key_file} holds no key (every line is empty or a # comment); write one key a line",
                param_hint="--api-key-file",
            )
        keys += found
    return keys


def _static_dir(path: Path | None) -> Path | None:
    """--path must name an existing directory, checked before the model loads."""
    if path is not None and not path.is_dir():
        raise typer.BadParameter(f"not a directory: {path}", param_hint="--path")
    return path


def _slot_dir(path: Path | None) -> str:
    """--slot-save-path must name an existing directory (llama-server: "not a directory")."""
    if path is None:
        return ""
    if not path.is_dir():
        raise typer.BadParameter(f"not a directory: {path}", param_hint="--slot-save-path")
    return str(path)
