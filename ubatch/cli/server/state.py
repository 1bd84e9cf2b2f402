"""What every route of `ubatch server` reads: the command-line options, the engine once the
model has loaded, and the prompt handling the completion and tokenizer routes share.

It is its own module so that the route modules can depend on it without depending on the app
that wires them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ubatch.cli.server.defaults import DEFAULT_MAX_BODY_SIZE, DEFAULT_MAX_JSON_DEPTH, DEFAULT_TIMEOUT_S
from ubatch.cli.server.http import bad_request
from ubatch.cli.server.request.params import ServerDefaults
from ubatch.engine.chat.template import ChatTemplate
from ubatch.engine.grammar import Grammar
from ubatch.engine.sampling.chain import SamplerParams
from ubatch.engine.serve.embedding_task import EmbeddingRunner
from ubatch.engine.serve.engine_loop import EngineLoop
from ubatch.engine.serve.handle import EngineHandle
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.serve.stats import TokenTotals
from ubatch.engine.serve.task import IdCounter, context_error


@dataclass
class ServerOptions:
    """Server-wide settings from the command line (llama-server's flags of the same names)."""

    api_keys: tuple[str, ...] = ()
    metrics: bool = False
    slots: bool = True
    slot_save_path: str = ""  # --slot-save-path DIR: POST /slots/{id}?action=save|restore (cli/server/routes/slots.py)
    alias: str | None = None
    chat_template: str | None = None  # --chat-template NAME|FILE|JINJA
    jinja: bool = True
    n_predict: int = -1
    sampling: SamplerParams = field(default_factory=SamplerParams)
    cache_prompt: bool = True
    embedding: bool = False  # --embedding: the embedding routes answer (completions still do too)
    pooling: str | None = None  # --pooling none|mean|cls|last|rank (None: the model's pooling type)
    reranking: bool = False  # --reranking: /rerank answers (implies embedding, pooling rank)
    tags: tuple[str, ...] = ()  # --tags, listed in /v1/models
    aliases: tuple[str, ...] = ()  # --alias a,b: every name the model answers to (first: its id)
    cors_origins: str = "localhost"  # reflect only localhost origins; "*" is llama.cpp's (it warns)
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = False
    api_prefix: str = ""
    grammar: Grammar | None = None  # --grammar / --grammar-file / -j, compiled: every request's default
    props: bool = False  # --props: POST /props may change the server's settings
    prefill_assistant: bool = True  # a final assistant message is continued, not closed
    embd_normalize: int = 2  # --embd-normalize: the default of embedding requests
    stop: tuple[str, ...] = ()  # -r / --reverse-prompt: default stop strings of every request
    special: bool = False  # -sp: special tokens appear in the output text
    n_keep: int = 0  # --keep: the default n_keep of every request
    max_body_size: int = DEFAULT_MAX_BODY_SIZE  # --max-body-size: bytes; a larger body is a 413
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH  # --max-json-depth: deeper JSON is a 400
    timeout: int = DEFAULT_TIMEOUT_S  # -to: seconds a body may take between chunks (408)
    reasoning_format: str = "auto"  # --reasoning-format: none | deepseek | deepseek-legacy | auto
    reasoning_budget: int = -1  # --reasoning-budget: tokens a thinking block may take (-1 unlimited)
    reasoning_budget_message: str = ""  # --reasoning-budget-message: written before the forced end tag
    reasoning: str = "auto"  # -rea on|off|auto
    webui: bool = True  # --webui/--no-webui: the chat page at / and /engine (cli/server/routes/webui.py)
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
class ServerEngine:
    """What the server runs its requests on, assembled by cli/server/run.py: the scheduler, the
    engine loop whose door the routes submit to, and the embedding runner (its rank head)."""

    scheduler: Scheduler
    loop: EngineLoop
    embeddings: EmbeddingRunner

    def stop(self) -> None:
        self.loop.stop()


class ServerState:
    """What the routes read: the options, and the engine once the model has loaded."""

    def __init__(self, options: ServerOptions | None = None) -> None:
        self.options = options or ServerOptions()
        self.engine: ServerEngine | None = None  # None while loading: every route answers 503
        self.defaults = ServerDefaults()
        self.ids = IdCounter()
        self.model_id = self.options.alias or ""
        self.chat: ChatTemplate | None = None
        self.max_token_chars = 1  # the longest token text: no token covers more of a prompt
        self._handle: EngineHandle | None = None
        self.scraped = TokenTotals()  # the token totals at the last /metrics read

    def attach(self, engine: ServerEngine) -> None:
        h = EngineHandle.of(engine.scheduler)
        o, m = self.options, h.model
        model = engine.scheduler.ctx.model  # at start-up, before any request: the routes read `h`
        self.chat = ChatTemplate.for_model(model, o.chat_template, o.jinja)  # a bad --chat-template fails here
        sampling = replace(
            o.sampling, reasoning_budget_tokens=o.reasoning_budget, reasoning_budget_message=o.reasoning_budget_message
        )
        self.defaults = ServerDefaults(
            sampling=sampling,
            n_predict=o.n_predict,
            n_ctx_slot=h.n_ctx_slot,
            n_parallel=h.n_slots,
            n_vocab=m.hparams.n_vocab,
            cache_prompt=o.cache_prompt,
            n_cache_reuse=h.cache_reuse,
            stop=list(o.stop),
            grammar=o.grammar,
            n_keep=o.n_keep,
            special=o.special,
            vocab=h.vocab,
            n_lora=len(h.plan.loras),
        )
        self.model_id = o.model_name(m.path)  # llama-server's: the first alias, else the path
        v = h.vocab
        self.max_token_chars = max(1, max((len(v.token_text(i)) for i in range(v.n_tokens)), default=1))
        self._handle = h
        self.engine = engine  # last: this makes the server ready

    def eng(self) -> ServerEngine:
        """The engine; routes run only once it is attached (the Gate answers 503 before)."""
        assert self.engine is not None
        return self.engine

    def handle(self) -> EngineHandle:
        """What the routes may know of the engine (vocab, model metadata, per-slot context)."""
        assert self._handle is not None
        return self._handle

    def tokenize_prompt(
        self, parts: list[str | int], add_special: bool = True, parse_special: bool = True, n_ctx: int = 0
    ) -> list[int]:
        """One prompt of strings and token ids -> token ids; BOS only before a leading string.

        With `n_ctx`, a prompt that cannot fit is refused before it is tokenized: no token covers
        more than `max_token_chars` characters, which bounds its token count from below. So a
        10 MB prompt costs a length check, not seconds of tokenizing on the event loop."""
        n_chars = sum(len(p) for p in parts if isinstance(p, str))
        if n_ctx > 0 and n_chars > 0:  # (token ids alone are counted exactly below)
            at_least = sum(1 for p in parts if not isinstance(p, str)) + -(-n_chars // self.max_token_chars)
            if (err := context_error(at_least, n_ctx, at_least=True)) is not None:
                raise err
        vocab, out = self.handle().vocab, []
        for i, p in enumerate(parts):
            if isinstance(p, str):
                out += vocab.tokenize(p, add_special and i == 0, parse_special)
            else:
                out.append(p)
        if any(not 0 <= t < vocab.n_tokens for t in out):
            raise bad_request("Prompt contains invalid tokens")
        return out
