"""`ubatch server`: llama-server's flags and defaults, checked and turned into settings.

This module is the command line only: the options (shared ones from cli/options.py and the
flag groups: sampling, context, the settings' own in cli/server/options.py, the few that several
settings are made of here), the checks that must fail before anything loads, and the settings
filled in. Binding, loading the model and running uvicorn are in
cli/server/run.py; the HTTP layer is cli/server/app.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import typer

from ubatch.cli import validate
from ubatch.cli.common import err_console, process_escapes, read_text_file, user_errors
from ubatch.cli.context_flags import ContextFlags, context_options
from ubatch.cli.flag_group import Refine, flag_group, refine
from ubatch.cli.lora_flags import LoraFlags, lora_options
from ubatch.cli.options import MODEL, SERVER, opt
from ubatch.cli.parallel_flags import ParallelFlags, parallel_options
from ubatch.cli.sampling_flags import SamplingFlags, sampling_options
from ubatch.cli.server.options import EngineOptions, ServerOptions
from ubatch.cli.spec_flags import SpecFlags, spec_options

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
@flag_group(ServerOptions, "options")
@flag_group(EngineOptions, "engine")
def server(
    alias: Optional[str] = _flag(
        None, "-a", "--alias", help="model name(s), comma-separated: the id and aliases in /v1/models", panel=MODEL
    ),
    tags: Optional[str] = _flag(None, "--tags", help="comma-separated tags listed in /v1/models", panel=MODEL),
    chat_template: Optional[str] = opt("chat_template", None),
    chat_template_file: Optional[Path] = opt("chat_template_file", None),
    host: str = _flag("127.0.0.1", "--host", help="addresses to listen on, comma-separated (IPv4, IPv6, *.sock)"),
    port: int = _flag(8080, "--port", help="port to listen on (0 = any free port)"),
    api_key: Optional[str] = _flag(
        None,
        "--api-key",
        envvar="LLAMA_API_KEY",
        help="API key(s), comma-separated; required on every route but /health and the web page",
    ),
    api_key_file: Optional[Path] = _flag(None, "--api-key-file", help="file with one API key per line"),
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
    keep: int = opt("keep", 0, help="tokens a context shift keeps (-1 = all)"),
    device: str = opt("device", "auto"),
    reverse_prompt: Optional[list[str]] = _flag(
        None, "-r", "--reverse-prompt", help="default stop string of every request (repeatable)", panel=MODEL
    ),
    options: ServerOptions = ServerOptions(),
    engine: EngineOptions = EngineOptions(),
    context: ContextFlags = ContextFlags(),
    sampling: SamplingFlags = SamplingFlags(),
    spec: SpecFlags = SpecFlags(),
    tp: ParallelFlags = ParallelFlags(),
    lora: LoraFlags = LoraFlags(),
) -> None:
    o, e = options, engine
    validate.in_range("--port", port, "port", 0, 65535)
    validate.positive("-to", o.timeout, "timeout")
    validate.positive("--max-body-size", o.max_body_size, "max_body_size")
    validate.positive("--max-json-depth", o.max_json_depth, "max_json_depth")
    validate.at_least("--cache-reuse", e.cache_reuse, "n_cache_reuse", 1, sentinel=(0, "off"))
    validate.at_least("-cram", e.cache_ram, "cache_ram", 0, sentinel=(-1, "no limit"))
    validate.fraction("-sps", e.slot_prompt_similarity, "slot_prompt_similarity")
    validate.generation_flags(o.n_predict, keep)
    validate.choice("--reasoning-format", o.reasoning_format, "reasoning_format", REASONING_FORMATS)
    reasoning = _on_off_auto("--reasoning", o.reasoning)
    validate.at_least("--reasoning-budget", o.reasoning_budget, "reasoning_budget", 0, sentinel=(-1, "unrestricted"))
    if e.pooling is not None:
        validate.choice("--pooling", e.pooling, "pooling", ("none", "mean", "cls", "last", "rank"))
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

    from ubatch.cli.server.run import load_engine, serve

    options = replace(
        o,
        api_keys=tuple(keys),
        slot_save_path=_slot_dir(slot_save_path),
        webui_path=_static_dir(static_path),
        aliases=_csv(alias),  # (the `alias` field is a one-name shorthand for the Python API and tests)
        tags=_csv(tags),
        chat_template=chat_template,
        sampling=sampling.sampler_params(),
        embedding=e.embedding or e.reranking,
        pooling="rank" if e.reranking else e.pooling,
        reranking=e.reranking,
        api_prefix=o.api_prefix.rstrip("/"),
        grammar=grammar,
        stop=tuple(process_escapes(r) for r in reverse_prompt or []),
        n_keep=keep,
        reasoning=reasoning,
    )
    engine = replace(e, context=context, device=str(dev), spec=spec, tp=tp, lora=lora, quiet=log_disable)
    serve(
        host,
        port,
        options,
        lambda: load_engine(engine),
        timeout=o.timeout,
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
