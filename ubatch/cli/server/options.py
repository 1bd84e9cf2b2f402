"""`ubatch server`'s settings, each flag declared once: a field here that is a flag (`flag`,
`shared_flag`) is also its command-line option (cli/flag_group.py adds it to the command), and the
command fills in the fields that come from several flags or need checks (API keys, aliases, the
sampling defaults, the resolved device). `ServerOptions` is what the routes read;
`EngineOptions` what the engine is loaded and run with (cli/server/run.py). Kept free of the
engine's imports: `ubatch --help` does not load torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ubatch.cli.context_flags import ContextFlags
from ubatch.cli.flag_group import flag, shared_flag
from ubatch.cli.lora_flags import LoraFlags
from ubatch.cli.options import BATCH, CTX, MODEL, SERVER
from ubatch.cli.parallel_flags import ParallelFlags
from ubatch.cli.server.defaults import (
    DEFAULT_MAX_BODY_SIZE,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_TIMEOUT_S,
    HEADER_TIMEOUT_CAP_S,
)
from ubatch.cli.spec_flags import SpecFlags

if TYPE_CHECKING:
    from ubatch.engine.grammar import Grammar
    from ubatch.engine.sampling.chain import SamplerParams

EMBD = "Embeddings"
_server = functools.partial(flag, panel=SERVER)
_model, _ctx, _embd = (functools.partial(flag, panel=p) for p in (MODEL, CTX, EMBD))


@dataclass
class ServerOptions:
    """Server-wide settings from the command line (llama-server's flags of the same names)."""

    api_keys: tuple[str, ...] = ()  # --api-key, --api-key-file
    metrics: bool = _server(False, "--metrics", help="enable the Prometheus /metrics endpoint")
    slots: bool = _server(True, "--slots/--no-slots", help="expose the /slots endpoint")
    slot_save_path: str = ""  # --slot-save-path DIR: POST /slots/{id}?action=save|restore (cli/server/routes/slots.py)
    alias: str | None = None
    chat_template: str | None = None  # --chat-template NAME|FILE|JINJA
    jinja: bool = shared_flag("jinja", True)
    n_predict: int = shared_flag("n_predict", -1, help="default tokens to generate per request (-1 = unlimited)")
    sampling: SamplerParams | None = None  # -s, --temp, ...: every request's defaults (None: the sampler's)
    cache_prompt: bool = _ctx(
        True, "--cache-prompt/--no-cache-prompt", help="reuse the slot's common prefix with the previous request"
    )
    embedding: bool = False  # --embedding: the embedding routes answer (completions still do too)
    pooling: str | None = None  # --pooling none|mean|cls|last|rank (None: the model's pooling type)
    reranking: bool = False  # --reranking: /rerank answers (implies embedding, pooling rank)
    tags: tuple[str, ...] = ()  # --tags, listed in /v1/models
    aliases: tuple[str, ...] = ()  # --alias a,b: every name the model answers to (first: its id)
    # reflect only localhost origins; "*" is llama.cpp's (it warns)
    cors_origins: str = _server(
        "localhost",
        "--cors-origins",
        help="allowed origins, comma-separated; 'localhost' reflects only localhost origins; '*' all",
    )
    cors_methods: str = _server("GET, POST, DELETE, OPTIONS", "--cors-methods", help="allowed CORS methods")
    cors_headers: str = _server("*", "--cors-headers", help="allowed CORS headers")
    cors_credentials: bool = _server(
        False, "--cors-credentials/--no-cors-credentials", help="allow credentials for CORS"
    )
    api_prefix: str = _server("", "--api-prefix", help="prefix every route is also served under")
    grammar: Grammar | None = None  # --grammar / --grammar-file / -j, compiled: every request's default
    props: bool = _server(False, "--props", help="let POST /props change server settings")
    prefill_assistant: bool = _model(
        True, "--prefill-assistant/--no-prefill-assistant", help="continue a final assistant message"
    )
    embd_normalize: int = _embd(
        2, "--embd-normalize", help="embedding normalisation: -1 none, 0 max-abs, 2 Euclidean, p>2 p-norm"
    )
    stop: tuple[str, ...] = ()  # -r / --reverse-prompt: default stop strings of every request
    special: bool = shared_flag("special", False)  # special tokens appear in the output text
    n_keep: int = 0  # --keep: the default n_keep of every request
    max_body_size: int = _server(
        DEFAULT_MAX_BODY_SIZE,
        "--max-body-size",
        help="largest request body in bytes; a larger one is refused with 413 before it is read",
    )
    max_json_depth: int = _server(
        DEFAULT_MAX_JSON_DEPTH,
        "--max-json-depth",
        help="deepest nesting of arrays and objects in a request body; deeper is a 400",
    )
    timeout: int = _server(
        DEFAULT_TIMEOUT_S,
        "-to",
        "--timeout",
        help=f"read/write timeout in seconds: idle keep-alive, a request body's next chunk (408), "
        f"request headers (at most {HEADER_TIMEOUT_CAP_S} s, then the connection is closed)",
    )
    reasoning_format: str = _model(
        "auto",
        "--reasoning-format",
        help="thinking in chat replies: none (left in content), deepseek or auto (moved to reasoning_content)",
    )
    reasoning_budget: int = _model(
        -1,
        "--reasoning-budget",
        help="token budget for thinking: -1 unrestricted, 0 end it at once, N > 0 force its end after N tokens",
    )
    reasoning_budget_message: str = _model(
        "",
        "--reasoning-budget-message",
        help="text written before the forced end-of-thinking tag when the budget runs out",
    )
    # on | off | auto (the command reads llama.cpp's other spellings into these)
    reasoning: str = _model(
        "auto",
        "-rea",
        "--reasoning",
        help="thinking in chat: on, off (the template's enable_thinking=false) or auto (the template's default)",
    )
    webui: bool = _server(
        True, "--webui/--no-webui", help="serve the chat page at / and the engine's live view at /engine"
    )
    webui_path: Path | None = None  # --path DIR: serve this folder at / instead of the bundled chat page

    @property
    def enable_thinking(self) -> bool:
        """The templates' enable_thinking: off with -rea off, as llama-server (a budget, even of
        0, leaves the template alone: the sampler ends the block instead)."""
        return self.reasoning != "off"

    def model_aliases(self) -> list[str]:
        """`--alias` names as llama-server keeps them: a set, so sorted and without repeats."""
        return sorted({*self.aliases, *([self.alias] if self.alias else [])})

    def model_name(self, path: object) -> str:
        """The model's id in every response: the first alias, else the model path as given."""
        aliases = self.model_aliases()
        return aliases[0] if aliases else str(path)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """What the server loads and how its engine runs: the model, its context, embeddings,
    speculation and the scheduler's settings."""

    model: Optional[Path] = shared_flag("model", None)  # None: the bundled default model
    # -c -b -ub -kvu -ctk -ctv -t --backend; -np: slots, one sequence each (resolved: never -1);
    # -c is split across the slots unless -kvu
    context: ContextFlags = field(default_factory=ContextFlags)
    device: str = "cpu"  # --device, resolved
    warmup: bool = shared_flag("warmup", True)
    context_shift: bool = shared_flag(
        "context_shift", False, help="when a slot's context fills, drop half of it and continue"
    )
    cache_reuse: int = _ctx(0, "--cache-reuse", help="min chunk size to reuse from the cache via KV shifting (0 = off)")
    cache_ram: int = _ctx(
        8192,
        "-cram",
        "--cache-ram",
        help="MiB of host memory for prompts that leave the KV cache, restored instead of prefilled (0 = off, -1 = no limit)",
    )
    slot_prompt_similarity: float = _ctx(
        0.1, "-sps", "--slot-prompt-similarity", help="pick the idle slot whose cache matches this much of the prompt"
    )
    cont_batching: bool = flag(
        True,
        "-cb/-nocb",
        "--cont-batching/--no-cont-batching",
        help="mix prompt chunks into generation batches",
        panel=BATCH,
    )
    # hidden-state rows, every row of a batch an output
    embedding: bool = _embd(False, "--embedding", "--embeddings", help="serve /embedding and /v1/embeddings")
    pooling: Optional[str] = _embd(None, "--pooling", help="none, mean, cls, last, rank (default: the model's)")
    reranking: bool = _embd(
        False, "--reranking", "--rerank", help="serve /rerank (needs a model with a rank head)"
    )  # embedding with rank pooling
    spec: SpecFlags | None = None  # the speculative flags (cli/spec_flags.py)
    tp: ParallelFlags = field(default_factory=ParallelFlags)  # tensor parallelism (-tp, -sm row)
    lora: LoraFlags = field(default_factory=LoraFlags)  # --lora, --lora-scaled, --lora-init-without-apply
    quiet: bool = False  # no startup or per-slot log lines
