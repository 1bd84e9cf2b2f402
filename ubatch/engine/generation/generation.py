"""One sequence's generation, written once for every way ubatch generates.

One-shot completion, chat turns, the server's slots and the `Llama` API all turn logits into
tokens with the same rules, so they live here and nowhere else: the sampler (with logit biases,
--ignore-eos and the reasoning budget's forced tokens), the end-of-generation check, stop
strings with llama-server's holdback (text that might still become a stop string is not shown
yet), the n_predict and context limits, top-n log-probabilities, and the context shift. A
`Generation` never decodes: the caller does (one row per step for a completion, one row among
many for a server slot), which is what lets a scheduler batch several sequences and, later,
speculative decoding add several rows per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ubatch.engine.grammar import Grammar
from ubatch.engine.grammar.sampler import GrammarSampler
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.sampling.batched import Row, single_threaded
from ubatch.engine.sampling.bias import LogitBias
from ubatch.engine.sampling.chain import Sampler
from ubatch.engine.vocab.token_stream import TokenStreamer
from ubatch.engine.vocab.vocab import Vocab

# The most top candidates reported per token. llama.cpp reports up to the whole vocabulary, which
# for a 262k vocabulary is a full sort and ~25 MB of JSON per token, and the engine thread that pays
# for it is every slot's. Five times OpenAI's top_logprobs limit (20) keeps every request's cost small.
N_PROBS_MAX = 100


@dataclass(slots=True)
class GenerationParams:
    """What one request asks of its generation (the part of llama.cpp's params that applies)."""

    n_predict: int = -1  # -1: until end of generation or a full context
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    n_probs: int = 0  # top candidates reported per token (0: no log-probabilities; at most N_PROBS_MAX)
    ctx_shift: bool = False  # when the context fills: shift (True) or stop (False)
    n_keep: int = 0  # tokens a shift keeps at the start (BOS included; the caller resolves -1)
    n_discard: int = 0  # tokens a shift drops; 0: half of those not kept
    special: bool = False  # -sp: control tokens appear in the text (end-of-generation ones never do)
    # llama-server's preserved_tokens: control tokens whose text appears even without `special`,
    # because a chat reply's parser must see them (e.g. <tool_call>, [TOOL_CALLS], <think>)
    preserved: frozenset[int] = frozenset()
    grammar: Grammar | None = None  # GBNF the generated text must follow (engine/grammar)


@dataclass(frozen=True, slots=True)
class TokenProb:
    """The sampled token's log-probability and the top-n candidates (before sampling)."""

    id: int
    piece: bytes
    logprob: float
    top: list[tuple[int, bytes, float]]


@dataclass(slots=True)
class Step:
    """One sampled token: the text that may be shown now, and whether generation ended."""

    token: int
    text: str
    prob: TokenProb | None
    done: bool


def find_partial_stop(text: str, word: str) -> int:
    """Start of the longest suffix of `text` that is a proper prefix of `word`, or -1."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return len(text) - n
    return -1


def shift_sequence(memory: KVMemory, seq_id: int, n_past: int, n_keep: int, n_discard: int = 0) -> int:
    """llama.cpp's context shift: keep the first n_keep cells, drop n_discard after them (half of
    the rest when 0), slide the remainder down; K is re-rotated at the next decode.
    Returns how many cells were dropped."""
    n_keep = max(0, min(n_keep, n_past - 1))
    n_left = n_past - n_keep
    n_discard = max(0, min(n_discard or n_left // 2, n_left - 1))
    memory.seq_rm(seq_id, n_keep, n_keep + n_discard)
    memory.seq_add(seq_id, n_keep + n_discard, n_past, -n_discard)
    return n_discard


class Generation:
    """The per-sequence state machine: `sample` a token from a logits row, let the caller decode
    it (after `make_room`), then `decoded()`; `finish()` returns the text held back at the end.

    `cache` is the caller's list of the tokens the sequence's KV cells hold, by position; the
    generation appends what gets decoded and removes what a context shift drops, so the list
    stays true for prompt caching and chat turns.
    """

    def __init__(
        self, vocab: Vocab, sampler: Sampler, params: GenerationParams, n_ctx: int, cache: list[int] | None = None
    ) -> None:
        self.vocab, self.sampler, self.params, self.n_ctx = vocab, sampler, params, n_ctx
        self.cache = cache if cache is not None else []
        self.streamer = TokenStreamer(vocab, params.special)
        self.tokens: list[int] = []  # every sampled token, an end-of-generation one included
        self.probs: list[TokenProb] = []
        self.text = ""  # the answer so far (cut at a stop string)
        self.n_sent = 0  # characters of `text` handed out as Step.text
        self.sampled = -1  # the last sampled token: the next row to decode
        self.stop_reason = ""  # "eog" | "word" | "length" | "context"; "" while generating
        self.stopping_word = ""
        self.context_full = False  # the context filled (and could not shift), or was shifted
        self.has_new_line = False
        self.n_shifts = 0
        self.t_sample_ms = 0.0
        self.grammar = GrammarSampler(params.grammar, vocab) if params.grammar is not None else None
        bias = list(params.logit_bias)
        if params.ignore_eos:  # llama.cpp: a logit bias of -inf on every end-of-generation token
            bias += [(t, float("-inf")) for t in sorted(vocab.eog)]
        self._bias = LogitBias(bias) if bias else None
        self._row: Row | None = None  # the last `row`

    @property
    def n_decoded(self) -> int:
        """Tokens sampled so far (llama-server's n_decoded; an end-of-generation token counts)."""
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def truncated(self) -> bool:
        """llama-server's `truncated`: the context ran out, or tokens were shifted out of it."""
        return self.context_full or self.n_shifts > 0

    def accept_prompt(self, tokens: list[int]) -> None:
        """Feed the prompt into the sampler's penalty history."""
        for t in tokens:
            self.sampler.accept(t, generated=False)
        if self.grammar is not None:  # the prompt does not advance the grammar, only penalties
            self.grammar.seen.update(tokens)

    def sample(self, logits: torch.Tensor, choose: Callable[[torch.Tensor], int] | None = None) -> Step:
        """Sample the next token from `logits` and apply llama-server's process_token rules.
        `choose` replaces the sampler's draw (speculative rejection sampling, engine/spec/verify.py);
        it sees the logits after the biases. The row is left as it was given."""
        t0 = time.perf_counter()
        p = self.params
        x = logits.float()
        lp = torch.log_softmax(x, -1) if p.n_probs > 0 else None
        with nullcontext() if self.sampler.argmax_only and self.grammar is None else single_threaded():
            if self._bias is None:
                tok = self._choose(x, choose)
            else:
                with self._bias.on(x) as biased:
                    tok = self._choose(biased, choose)
        prob = None
        if lp is not None:  # a partial selection of k: O(V) per token whatever n_probs asked for
            top = torch.topk(lp, min(p.n_probs, N_PROBS_MAX, lp.numel()))
            piece = self.vocab.token_to_piece
            ids, vals = top.indices.tolist(), top.values.tolist()  # plain numbers: no per-element tensors
            prob = TokenProb(tok, piece(tok), float(lp[tok]), [(i, piece(i), v) for i, v in zip(ids, vals)])
            self.probs.append(prob)
        self.t_sample_ms += (time.perf_counter() - t0) * 1e3
        return Step(tok, self._process(tok), prob, self.done)

    def _choose(self, x: torch.Tensor, choose: Callable[[torch.Tensor], int] | None) -> int:
        """The chain's (or `choose`'s) token from the biased row, the grammar's check, the
        sampler's history."""
        x = self.sampler.constrain(x)  # the reasoning budget's forced token, if it forces one now
        tok = self.sampler.sample(x) if choose is None else choose(x)
        if self.grammar is not None:  # llama.cpp: check the chain's pick, resample only if refused
            tok = self.grammar.choose(x, tok, self.sampler)
            self.grammar.accept(tok)
        self.sampler.accept(tok)
        return tok

    def row(self, index: int) -> Row | None:
        """This generation's row `index` for the batched pass (engine/sampling/batched.py), or
        None when it must be sampled alone (`sample`): its chain does not batch, or a grammar,
        a reasoning budget or log-probabilities look at the row."""
        chain = self.sampler.row_chain
        if chain is None or self.grammar is not None or self.params.n_probs > 0 or self.sampler.budget is not None:
            return None
        row = self._row
        if row is None or row.index != index:  # kept: a decode step's row is at the same index each time
            row = self._row = Row(index, chain, self.sampler.rng, self._bias)
        return row

    def took(self, tok: int, ms: float = 0.0) -> Step:
        """The batched pass drew `tok` from this generation's row: what `sample` does after its draw."""
        self.sampler.accept(tok)
        self.t_sample_ms += ms
        return Step(tok, self._process(tok), None, self.done)

    def _process(self, tok: int) -> str:
        p = self.params
        self.sampled = tok
        self.tokens.append(tok)
        is_eog = self.vocab.is_eog(tok)  # once per token: callers may count the calls
        if not is_eog:  # an end-of-generation token is not part of the text
            if tok in p.preserved and not p.special:
                # a control token's text is whole ASCII-like text: what the decoder holds back
                # before it can no longer become a character (U+FFFD, as the decoder would give)
                piece = self.streamer.flush() + self.vocab.token_to_piece(tok, True).decode("utf-8", "replace")
            else:
                piece = self.streamer.push(tok)
            self.text += piece
            self.has_new_line = self.has_new_line or "\n" in piece
        send = True
        tail = self.text[self.n_sent :]
        if p.stop:
            hits = [(tail.find(w), w) for w in p.stop if w in tail]
            if hits:
                pos, word = min(hits)
                self.text = self.text[: self.n_sent + pos]
                self.stop_reason, self.stopping_word = "word", word
            elif not is_eog:
                send = all(find_partial_stop(tail, w) < 0 for w in p.stop)
        if is_eog:
            self.stop_reason = "eog"
        elif not self.stop_reason:
            full = len(self.cache) + 1 >= self.n_ctx and not p.ctx_shift  # llama.cpp: n_past + 1 >= n_ctx
            self.context_full = self.context_full or full
            if 0 <= p.n_predict <= self.n_decoded:
                self.stop_reason = "length"
            elif full:
                self.stop_reason = "context"
        if not send:
            return ""
        out = self.text[self.n_sent :]
        self.n_sent = len(self.text)
        return out

    def make_room(self, memory: KVMemory, seq_id: int) -> bool:
        """Before decoding the sampled token: shift the context if it is full. True if shifted."""
        if not self.params.ctx_shift or len(self.cache) + 1 < self.n_ctx:
            return False
        n_keep = min(self.params.n_keep, len(self.cache) - 1)
        n = shift_sequence(memory, seq_id, len(self.cache), n_keep, self.params.n_discard)
        del self.cache[n_keep : n_keep + n]
        self.n_shifts += 1
        return True

    def decoded(self) -> None:
        """The sampled token's K/V are now in the cache (at position len(cache))."""
        self.cache.append(self.sampled)

    def finish(self) -> str:
        """The text not handed out yet: held back for a stop string or an incomplete character
        (after a stop string, only what precedes it)."""
        if self.stop_reason != "word":
            self.text += self.streamer.flush()
        out = self.text[self.n_sent :]
        self.n_sent = len(self.text)
        return out
