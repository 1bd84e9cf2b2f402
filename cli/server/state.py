"""What every route of `ubatch server` reads: the command-line options, the scheduler once the
model has loaded, and the prompt handling the completion and tokenizer routes share.

It is its own module so that the route modules can depend on it without depending on the app
that wires them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ubatch.cli.server.request.oai import chat_messages
from ubatch.cli.server.request.params import ServerDefaults
from ubatch.engine.chat.template import ChatTemplate
from ubatch.engine.errors import UbatchError
from ubatch.engine.grammar import Grammar
from ubatch.engine.sampling.chain import SamplerParams
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.serve.task import IdCounter, RequestError, context_error


@dataclass
class ServerOptions:
    """Server-wide settings from the command line (llama-server's flags of the same names)."""

    api_keys: tuple[str, ...] = ()
    metrics: bool = False
    slots: bool = True
    slot_save_path: str = ""  # --slot-save-path DIR: POST /slots/{id}?action=save|restore (cli/routes_slots.py)
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


class ServerState:
    """What the routes read: the options, and the scheduler once the model has loaded."""

    def __init__(self, options: ServerOptions | None = None) -> None:
        self.options = options or ServerOptions()
        self.scheduler: Scheduler | None = None  # None while loading: every route answers 503
        self.defaults = ServerDefaults()
        self.ids = IdCounter()
        self.model_id = self.options.alias or ""
        self.chat: ChatTemplate | None = None
        self.max_token_chars = 1  # the longest token text: no token covers more of a prompt

    def attach(self, scheduler: Scheduler) -> None:
        o, m = self.options, scheduler.ctx.model
        self.chat = ChatTemplate.for_model(m, o.chat_template, o.jinja)  # a bad --chat-template fails here
        self.defaults = ServerDefaults(
            sampling=o.sampling,
            n_predict=o.n_predict,
            n_ctx_slot=scheduler.n_ctx_slot,
            n_parallel=len(scheduler.slots),
            n_vocab=m.hparams.n_vocab,
            cache_prompt=o.cache_prompt,
            n_cache_reuse=scheduler.cache_reuse,
            stop=list(o.stop),
            grammar=o.grammar,
            n_keep=o.n_keep,
            special=o.special,
        )
        from ubatch.cli.server.info import model_name

        self.model_id = model_name(o, m.path)  # llama-server's: the first alias, else the path
        v = scheduler.vocab
        self.max_token_chars = max(1, max((len(v.token_text(i)) for i in range(v.n_tokens)), default=1))
        self.scheduler = scheduler  # last: this makes the server ready

    def sch(self) -> Scheduler:
        """The scheduler; routes run only once it is attached (the Gate answers 503 before)."""
        assert self.scheduler is not None
        return self.scheduler

    def render(self, messages: Any) -> str:
        """Chat messages -> the prompt text, through the model's (or --chat-template's) template."""
        assert self.chat is not None
        try:
            return self.chat.apply(chat_messages(messages))
        except UbatchError as e:  # a template that rejects these messages: the client's problem
            raise RequestError(str(e)) from None

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
        vocab, out = self.sch().vocab, []
        for i, p in enumerate(parts):
            if isinstance(p, str):
                out += vocab.tokenize(p, add_special and i == 0, parse_special)
            else:
                out.append(p)
        if any(not 0 <= t < vocab.n_tokens for t in out):
            raise RequestError("Prompt contains invalid tokens")
        return out
