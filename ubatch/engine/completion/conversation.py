"""A conversation on one sequence of a context, reusing the KV cache between turns (no printing).

Each turn renders the whole conversation with the chat template, and only the tokens the KV
cache does not hold yet are decoded:

* The cache holds the conversation as the model saw and wrote it: the previous prompts and the
  answer tokens it sampled (`tokens`). The answer's end-of-generation token is sampled but not
  decoded, and an answer cut by -n leaves its last token undecoded (`pending`).
* The next turn's text is found by rendering the conversation with a sentinel in place of the
  last answer: what follows the sentinel is the template's end of that answer (gemma:
  `<end_of_turn>\\n`) plus the new user turn and the generation prompt. Its tokens are
  appended to the cached ones, like llama-completion's conversation mode does, so the model
  sees its own answer tokens and a turn prefills only itself.
* When that is not possible (first turn, /clear, another template, messages dropped for room),
  the conversation is tokenized whole and the longest common prefix with the cache is kept, as
  llama-server's prompt cache does; the rest of the cache is removed with seq_rm.
* A sliding-window cache may have lost the cells a shortened prefix needs: all is prefilled again.

A conversation that no longer fits is refused (ContextFullError), or with ctx_shift loses its
oldest exchanges (and shifts within an answer where every cache is full-size). A turn's data
live here too: what it brings into the cache (`TurnInput`) and what it measured (`TurnStats`,
shown by /stats and --verbose); and `looks_like_base_model`, so the chat can say up front that a
model without a template or instruction tuning will ramble rather than answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

from ubatch.engine.batch import common_prefix
from ubatch.engine.chat.template import ChatTemplate
from ubatch.engine.completion.complete import CompletionStats, complete
from ubatch.engine.context.context import Context
from ubatch.engine.errors import UbatchError
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.params import context_holds
from ubatch.engine.sampling.chain import Sampler
from ubatch.engine.spec.speculative import Speculator
from ubatch.engine.units import DecodeRates

# stands in for the last answer while rendering; no template changes it (no spaces to trim)
SENTINEL = "\u2063ubatch\u2063answer\u2063"

Message = dict[str, str]  # {"role": ..., "content": ...}

# words of a model's name, fine-tune or tags that say it was tuned to follow instructions
INSTRUCT_MARKS = frozenset({"it", "instruct", "instruction", "chat", "sft", "dpo", "rlhf", "orpo", "assistant"})


def looks_like_base_model(metadata: Mapping[str, object], filename: str) -> bool:
    """A GGUF without a chat template whose name, fine-tune, tags and file name carry no mark of
    instruction tuning (`it`, `instruct`, `chat`, ...). Such a model continues text instead of
    answering: in a chat it rambles and rarely ends its turn, which looks like a bug unless said."""
    stored = metadata.get("tokenizer.chat_template")
    if isinstance(stored, str) and stored.strip():
        return False
    names = [filename]
    for key in ("general.name", "general.basename", "general.finetune", "general.tags"):
        v = metadata.get(key)
        names += [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []
    text = " ".join(names).lower()
    if "instruct" in text or "chat" in text:  # also inside words: openchat, 7binstruct
        return False
    return not INSTRUCT_MARKS.intersection(re.split(r"[^a-z0-9]+", text))


class ChatInputError(UbatchError):
    """A message the conversation refuses (empty, too long); the conversation goes on."""


class ContextFullError(ChatInputError):
    """The conversation no longer fits the context and no context-shift policy is enabled."""


@dataclass(slots=True)
class TurnStats(DecodeRates):
    """One turn, as /stats and --verbose show it."""

    turn: int = 0
    n_turn: int = 0  # tokens the new turn added to the conversation (incl. an undecoded answer token)
    n_prompt: int = 0  # tokens evaluated (prefilled) this turn
    n_reused: int = 0  # conversation tokens found in the KV cache
    n_gen: int = 0  # answer tokens (the end-of-generation token not counted)
    n_eval: int = 0  # single-token decodes
    t_prompt_ms: float = 0.0
    t_eval_ms: float = 0.0
    stop_reason: str = ""  # "eog", "length", "context", "interrupted"
    n_past: int = 0  # tokens in the cache afterwards
    n_shifts: int = 0
    n_dropped: int = 0  # messages dropped to make room
    reprocess: str = ""  # why the conversation was tokenized whole ("" = the turn's delta only)
    prompt_text: str = ""  # the whole conversation, formatted
    turn_text: str = ""  # the formatted text this turn appended (whole prompt when reprocessed)
    answer: str = ""


@dataclass(slots=True)
class TurnInput:
    """The tokens a turn must bring into the cache, and why they were chosen."""

    messages: list[Message]  # the conversation with the new user message
    text: str  # messages formatted, with the generation prompt
    target: list[int]  # the tokens the cache must hold before sampling
    n_turn: int
    turn_text: str
    reprocess: str = ""
    n_dropped: int = 0


@dataclass
class ChatSession:
    """`params` holds every answer's settings as the user gave them: n_predict, --ignore-eos,
    reverse prompts (-r), logit biases (-l), a grammar; ctx_shift drops the oldest exchanges
    when the conversation is full (and shifts within an answer where every cache can); n_keep
    is --keep, the tokens after BOS such a shift keeps (-1: the first prompt), resolved per turn."""

    ctx: Context
    template: ChatTemplate
    sampler: Sampler
    params: GenerationParams = field(default_factory=GenerationParams)
    system: str | None = None
    speculator: Speculator | None = None  # drafts verified with each step
    seq_id: int = 0
    messages: list[Message] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # what the KV cache holds, position i = tokens[i]
    turns: int = 0
    last: TurnStats | None = None
    n_generated: int = 0  # answer tokens over the session

    def __post_init__(self) -> None:
        self.vocab = self.ctx.model.vocab
        mem = self.ctx.memory
        self.shift_in_answer = self.params.ctx_shift and mem.can_shift  # K-shift: every cache holds all
        self.n_swa = self.ctx.model.hparams.n_swa if mem.is_iswa else 0
        self._stream: list[int] | None = None  # conversation tokens: cache + pending; None: re-render
        self._pending = 0  # sampled answer tokens at the end of _stream that are not decoded
        self._prev_text: str | None = None  # the formatted prompt of the last turn
        self._n_keep_first, self._dirty = 0, False
        self._undo: tuple[list[Message], list[int] | None, int, str | None] | None = None  # before /regen
        self.clear()

    @property
    def n_ctx(self) -> int:
        return self.ctx.cparams.n_ctx_seq

    # -- conversation state -------------------------------------------------------------------
    def clear(self) -> None:
        """Forget the conversation (the system prompt stays) and empty the sequence's cache."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self._reset_cache()
        self._stream, self._pending, self._prev_text = None, 0, None
        self.turns, self.last = 0, None

    def set_template(self, template: ChatTemplate) -> None:
        """Use another template from the next turn (the cache keeps the common prefix)."""
        self.template = template
        self._stream, self._prev_text = None, None

    def _reset_cache(self) -> None:
        self.ctx.memory.seq_rm(self.seq_id, -1, -1)
        self.tokens = []
        self._dirty = False

    def _truncate(self, n: int) -> int:
        """Keep the first n cached tokens; 0 if a sliding-window cache lost what they need."""
        mem = self.ctx.memory
        mem.seq_rm(self.seq_id, n, -1)
        if n > 0:
            lo, hi = mem.seq_pos_min(self.seq_id), mem.seq_pos_max(self.seq_id)
            if hi != n - 1 or (self.n_swa > 0 and lo > max(0, n - self.n_swa)):
                mem.seq_rm(self.seq_id, -1, -1)
                n = 0
        self.tokens = self.tokens[:n]
        return n

    def _tokenize(self, text: str, add_special: bool) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=True)

    def _turn_input(self, text: str) -> TurnInput:
        if not text.strip():
            raise ChatInputError("empty message: type something (or /exit to leave)")
        user = {"role": "user", "content": text}
        msgs = self.messages + [user]
        full = self.template.apply(msgs, True)
        turn = None
        reprocess = "" if self._stream is None and not self.tokens else "the conversation was re-rendered"
        if (
            self._stream is not None
            and self._prev_text is not None
            and len(self.messages) > 0
            and self.messages[-1]["role"] == "assistant"
        ):
            s = self.template.apply(self.messages[:-1] + [{"role": "assistant", "content": SENTINEL}, user], True)
            i = s.find(SENTINEL)
            if s.count(SENTINEL) == 1 and s[:i] == self._prev_text:
                tail = s[i + len(SENTINEL) :]
                new = self._tokenize(tail, add_special=False)
                turn = TurnInput(msgs, full, self._stream + new, self._pending + len(new), tail)
            else:
                reprocess = "the template renders the history differently now"
        if turn is None:
            toks = self._tokenize(full, add_special=True)
            turn = TurnInput(msgs, full, toks, len(toks), full, reprocess)
        if len(turn.target) > self.n_ctx - 4:
            turn = self._make_room(user, turn)
        return turn

    def _make_room(self, user: Message, turn: TurnInput) -> TurnInput:
        n_ctx = self.n_ctx
        if not self.params.ctx_shift:
            raise ContextFullError(
                f"the conversation would take {len(turn.target)} tokens but {context_holds(self.ctx.params, self.ctx.cparams)}: "
                "/clear to start over, or restart with a larger -c or with --context-shift"
            )
        head = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        rest = self.messages[len(head) :]
        dropped = 0
        while True:
            msgs = head + rest + [user]
            text = self.template.apply(msgs, True)
            toks = self._tokenize(text, add_special=True)
            if len(toks) <= n_ctx // 2 or not rest:
                break
            k = 1  # a whole exchange: up to the next user message
            while k < len(rest) and rest[k]["role"] != "user":
                k += 1
            rest, dropped = rest[k:], dropped + k
        if len(toks) > n_ctx - 4:
            raise ChatInputError(
                f"the message is too long: {len(toks)} tokens with the system prompt and the template, {context_holds(self.ctx.params, self.ctx.cparams)}; restart with a larger -c"
            )
        return TurnInput(
            msgs,
            text,
            toks,
            len(toks),
            text,
            f"dropped the {dropped} oldest messages to make room" if dropped else turn.reprocess,
            dropped,
        )

    # -- a turn -------------------------------------------------------------------------------
    def respond(
        self, text: str, progress: Callable[[int, int], None] | None = None, stop: Callable[[], bool] | None = None
    ) -> Iterator[str]:
        """Answer `text`: an iterator over the answer's text as it is generated; `self.last`
        holds the turn's numbers. Raises ChatInputError / ChatTemplateError (here, before
        anything changes) for a message the conversation cannot take.

        `stop` (polled between prefill ubatches and between decode steps; the chat's Ctrl-C
        flag) ends the answer with stop reason "interrupted": what was decoded stays in the cache
        and the partial answer in the history; a turn stopped during its prefill is forgotten.
        Closing the returned iterator early does the same. An exception raised inside it (an
        asynchronous KeyboardInterrupt) may land between two updates; then the cache is checked
        and, if it no longer agrees with the token list, emptied.
        """
        if self._dirty:  # an earlier turn was cut off during its own bookkeeping
            self._reset_cache()
            self._stream = None
        turn = self._turn_input(text)
        return self._run(turn, progress, stop)

    def _run(
        self, turn: TurnInput, progress: Callable[[int, int], None] | None, stop: Callable[[], bool] | None
    ) -> Iterator[str]:
        n_common = min(common_prefix(self.tokens, turn.target), len(turn.target) - 1)
        kept = self._truncate(n_common)
        if kept < n_common:
            turn.reprocess = "the sliding-window cache no longer holds the tokens the prefix needs"
        if self.params.n_keep < 0:
            n_keep = len(turn.target) if self.turns == 0 else self._n_keep_first
        else:
            n_keep = self.params.n_keep + int(self.vocab.add_bos)
        n_keep = min(n_keep, self.n_ctx - 4)
        if self.turns == 0:
            self._n_keep_first = n_keep
        self.turns += 1
        self.last = TurnStats(
            turn=self.turns,
            n_turn=turn.n_turn,
            n_reused=kept,
            n_dropped=turn.n_dropped,
            reprocess=turn.reprocess,
            prompt_text=turn.text,
            turn_text=turn.turn_text,
        )
        st = CompletionStats()
        cache = list(turn.target[:kept])  # kept equal to the sequence's cells by the generation
        sampled: list[int] = []
        pieces: list[str] = []
        completed = False
        self._dirty = True
        try:
            params = replace(self.params, ctx_shift=self.shift_in_answer, n_keep=n_keep)
            for ev in complete(
                self.ctx,
                turn.target[kept:],
                self.sampler,
                params,
                st,
                cache=cache,
                seq_id=self.seq_id,
                progress=progress,
                speculator=self.speculator,
                stop=stop,
            ):
                if ev.token >= 0 and not self.vocab.is_eog(ev.token):
                    sampled.append(ev.token)
                if ev.text:
                    pieces.append(ev.text)
                    yield ev.text
            completed = True
        finally:
            self._finish(turn, kept, st, cache, sampled, "".join(pieces), completed)

    def _finish(
        self,
        turn: TurnInput,
        kept: int,
        st: CompletionStats,
        seq: list[int],
        sampled: list[int],
        answer: str,
        completed: bool,
    ) -> None:
        ts = self.last
        assert ts is not None
        ts.n_prompt, ts.t_prompt_ms = st.n_prompt, st.t_prompt_ms
        ts.n_eval, ts.t_eval_ms, ts.n_shifts = st.n_eval, st.t_eval_ms, st.n_shifts
        ts.stop_reason = st.stop_reason if completed else "interrupted"
        undo, self._undo = self._undo, None
        if st.n_prompt == 0:  # stopped before the prompt was in: the turn did not happen
            self.tokens = turn.target[:kept]
            self._truncate(kept)
            ts.n_prompt, ts.n_past = 0, len(self.tokens)
            self.turns -= 1
            if undo is not None:  # a regeneration that never started: the old answer stays
                self.messages, self._stream, self._pending, self._prev_text = undo
            self._dirty = False
            return
        # `seq` is what the cache holds: the target, then each decoded answer token (after shifts)
        k = st.n_eval
        mem = self.ctx.memory
        ok = k <= len(sampled) and len(seq) == st.n_past
        if ok:
            mem.seq_rm(self.seq_id, len(seq), -1)  # a decode cut off by Ctrl-C may have placed cells
            ok = mem.seq_pos_max(self.seq_id) == len(seq) - 1
        if ok:
            self.tokens = seq
            self._stream, self._pending = seq + sampled[k:], len(sampled) - k
        else:  # the cache state is unknown: start the next turn from an empty cache
            self.ctx.memory.seq_rm(self.seq_id, -1, -1)
            self.tokens, self._stream, self._pending = [], None, 0
        self.messages = turn.messages + [{"role": "assistant", "content": answer}]
        self._prev_text = turn.text
        ts.n_gen, ts.n_past, ts.answer = len(sampled), len(self.tokens), answer
        self.n_generated += len(sampled)
        self._dirty = False

    def regenerate(
        self, progress: Callable[[int, int], None] | None = None, stop: Callable[[], bool] | None = None
    ) -> Iterator[str]:
        """Answer the last user message again (the cache keeps everything before the answer)."""
        if len(self.messages) < 2 or self.messages[-1]["role"] != "assistant":
            raise ChatInputError("nothing to regenerate yet")
        user = self.messages[-2]["content"]
        undo = (self.messages, self._stream, self._pending, self._prev_text)
        self.messages = self.messages[:-2]
        self._stream, self._prev_text = None, None
        self.turns -= 1
        try:
            it = self.respond(user, progress, stop)
        except BaseException:
            self.messages, self._stream, self._pending, self._prev_text = undo
            self.turns += 1
            raise
        self._undo = undo
        return it
