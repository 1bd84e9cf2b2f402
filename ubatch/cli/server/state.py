"""What every route of `ubatch server` reads: the command-line options, the engine once the
model has loaded, and the prompt handling the completion and tokenizer routes share.

It is its own module so that the route modules can depend on it without depending on the app
that wires them together.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ubatch.cli.server.http import bad_request
from ubatch.cli.server.options import ServerOptions
from ubatch.cli.server.request.params import ServerDefaults
from ubatch.engine.chat.template import ChatTemplate
from ubatch.engine.sampling.chain import SamplerParams
from ubatch.engine.serve.embedding_task import EmbeddingRunner
from ubatch.engine.serve.engine_loop import EngineLoop
from ubatch.engine.serve.handle import EngineHandle
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.serve.stats import TokenTotals
from ubatch.engine.serve.task import IdCounter, context_error


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
            o.sampling or SamplerParams(),
            reasoning_budget_tokens=o.reasoning_budget,
            reasoning_budget_message=o.reasoning_budget_message,
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
