"""One completion: prefill the prompt in n_batch chunks, then sample and decode token by token.

Yields events as tokens are produced so the CLI can stream them; the timings it records are the
ones llama-completion prints (prompt eval vs eval, sampling time).

A caller that must be able to stop it (Ctrl-C in the chat) passes `stop`, polled between ubatches
of the prefill and between decode steps: stopping there leaves the KV cells and the caller's token
list in step, which an exception landing at an arbitrary statement (an asynchronous
KeyboardInterrupt) cannot promise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ubatch.engine.batch import Batch, RowKind
from ubatch.engine.context.context import Context
from ubatch.engine.errors import ContextError
from ubatch.engine.generation.generation import Generation, GenerationParams, Step
from ubatch.engine.kv.memory import DecodeError, DecodeStatus
from ubatch.engine.params import context_holds
from ubatch.engine.sampling.chain import Sampler
from ubatch.engine.spec.speculative import Draft, SpecStats, Speculator, n_draft_max
from ubatch.engine.spec.verify import verify
from ubatch.engine.units import DecodeRates


@dataclass(slots=True)
class TokenEvent:
    token: int
    text: str  # newly completed text (UTF-8 sequences split over byte tokens are held back)


@dataclass(slots=True)
class CompletionStats(DecodeRates):
    n_prompt: int = 0
    t_prompt_ms: float = 0.0
    n_gen: int = 0  # tokens sampled
    n_eval: int = 0  # tokens decoded while generating (one per step; more with speculation)
    n_eval_calls: int = 0  # decode calls while generating (n_eval without speculation)
    t_eval_ms: float = 0.0
    t_sample_ms: float = 0.0
    stop_reason: str = ""  # "eog", "length", "context", "word", "interrupted" (`stop` said so)
    stopping_word: str = ""  # the stop string that ended it (stop_reason "word")
    n_past: int = 0  # tokens the sequence holds in the cache afterwards
    n_shifts: int = 0  # context shifts performed
    spec: SpecStats = field(default_factory=SpecStats)  # drafts verified (speculative decoding)


def check_prompt_fits(ctx: Context, n_prompt: int) -> None:
    if n_prompt > ctx.cparams.n_ctx_seq:
        raise ContextError(
            f"the prompt is {n_prompt} tokens but {context_holds(ctx.params, ctx.cparams)}; raise -c (context size) or shorten the prompt"
        )
    if n_prompt == 0:
        raise ContextError("the prompt is empty (0 tokens); give a prompt or enable BOS")


def decode_step(
    ctx: Context, gen: Generation, seq_id: int, spec: Speculator | None, stats: CompletionStats
) -> list[Step]:
    """Decode the sampled token (and a draft, if one is proposed); the target's next tokens.
    The one generation step every caller of a single sequence shares (completions, chat turns,
    the `Llama` API); the server's slots do the same per slot in engine/serve/slot_spec.py."""
    cache, p = gen.cache, gen.params
    te = time.perf_counter()  # eval time: drafting and the decode (sampling is counted apart)
    n = n_draft_max(gen.n_ctx, len(cache), p.n_predict, gen.n_decoded, spec.n_max) if spec else 0
    draft = spec.draft(seq_id, cache, gen.sampled, n) if spec is not None and n > 0 else Draft([])
    b = Batch.from_tokens([gen.sampled], len(cache), seq_id, kind=RowKind.GENERATED)
    for i, t in enumerate(draft.tokens):
        b.add(t, len(cache) + 1 + i, seq_id, True, RowKind.DRAFTED)
    td = time.perf_counter()
    try:
        ctx.decode(b)
    except DecodeError as e:  # no cells for the draft (a full window cache): verify nothing
        if e.code is not DecodeStatus.NO_KV_SLOT or not draft.tokens:
            raise
        draft = Draft([])
        ctx.decode(Batch.from_tokens([gen.sampled], len(cache), seq_id, kind=RowKind.GENERATED))
    t_end = time.perf_counter()
    stats.t_eval_ms += (t_end - te) * 1e3
    # the counts follow the cache list at once, not after sampling: a caller reading them after an
    # exception (an asynchronous KeyboardInterrupt) sees them agree with `cache`
    gen.decoded()
    stats.n_eval, stats.n_eval_calls, stats.n_past = stats.n_eval + 1, stats.n_eval_calls + 1, len(cache)
    if spec is None or not draft.tokens:
        return [gen.sample(ctx.logits[-1])]
    n_before = len(cache)
    v = verify(gen, ctx.logits, draft, ctx.memory, seq_id)
    ms = (t_end - td) * 1e3  # the verification's decode alone
    spec.stats.add(v.n_drafted, v.n_accepted, len(ctx.records), ms)
    stats.spec.add(v.n_drafted, v.n_accepted, len(ctx.records), ms)
    stats.n_eval, stats.n_past = stats.n_eval + len(cache) - n_before, len(cache)
    return v.steps


def complete(
    ctx: Context,
    prompt: list[int],
    sampler: Sampler,
    params: GenerationParams | None = None,
    stats: CompletionStats | None = None,
    *,
    cache: list[int] | None = None,
    seq_id: int = 0,
    progress: Callable[[int, int], None] | None = None,
    speculator: Speculator | None = None,
    stop: Callable[[], bool] | None = None,
) -> Iterator[TokenEvent]:
    """Generate what `params` asks (n_predict -1: until end of generation or a full context).

    `cache` holds the tokens sequence seq_id already has in its cells (a chat turn prefills only
    itself); `prompt` is decoded after them, and the list is kept equal to what the cells hold.
    When the context fills: with params.ctx_shift, the first n_keep tokens stay and half of the
    rest is discarded; without it generation stops (stop_reason "context"). `stats.n_past` is
    the sequence length afterwards; `progress` sees the prefill's ubatches (`Context.prefill`).
    With a `speculator`, each step decodes the sampled token and a draft in one batch and keeps
    what the target agrees with (engine/spec/verify.py); the tokens are the same as without it.

    `stop` is polled before the prefill, after each of its ubatches and before each decode step;
    when it returns True the completion ends with stop_reason "interrupted". Stopped during the
    prefill, the cells it placed are removed (`cache` and the cells keep agreeing, n_prompt stays
    0); stopped later, the last sampled token is left undecoded, as when -n cuts an answer.
    """
    stats = stats if stats is not None else CompletionStats()
    params = params if params is not None else GenerationParams()
    cache = cache if cache is not None else []
    n_past = len(cache)
    check_prompt_fits(ctx, n_past + len(prompt))
    if params.ctx_shift and not ctx.memory.can_shift:
        raise ContextError(
            "context shift needs every KV cache to hold the whole context; with a sliding-window model add --swa-full"
        )
    gen = Generation(ctx.model.vocab, sampler, params, ctx.cparams.n_ctx_seq, cache)
    stats.n_past = n_past
    t0 = time.perf_counter()
    if stop is None:
        ctx.prefill(prompt, n_past, seq_id, progress=progress)
    elif not _prefill_or_stop(ctx, prompt, n_past, seq_id, progress, stop):
        stats.stop_reason = "interrupted"
        return
    cache.extend(prompt)
    stats.n_prompt, stats.t_prompt_ms, stats.n_past = len(prompt), (time.perf_counter() - t0) * 1e3, len(cache)
    gen.accept_prompt(prompt)
    if params.n_predict == 0:  # llama-completion -n 0: evaluate the prompt, generate nothing
        stats.stop_reason = "length"
        return
    pending = [gen.sample(ctx.logits[-1])]
    interrupted = False
    while True:
        stats.n_gen, stats.t_sample_ms = gen.n_decoded, gen.t_sample_ms
        for step in pending:
            if gen.stop_reason == "eog" and step is pending[-1]:  # it carries what was held back
                step.text += gen.finish()
                if not step.text:
                    continue
            yield TokenEvent(step.token, step.text)
        if gen.done:
            break
        if stop is not None and stop():  # between steps: the cache list and the cells agree
            interrupted = True
            break
        stats.n_shifts += gen.make_room(ctx.memory, seq_id)
        pending = decode_step(ctx, gen, seq_id, speculator, stats)
    stats.stop_reason = "interrupted" if interrupted else gen.stop_reason
    stats.stopping_word = gen.stopping_word
    tail = gen.finish()
    if tail:
        yield TokenEvent(-1, tail)


class _Stopped(Exception):
    """`stop` said so after a prefill ubatch (raised through Context.prefill's progress callback)."""


def _prefill_or_stop(
    ctx: Context,
    prompt: list[int],
    n_past: int,
    seq_id: int,
    progress: Callable[[int, int], None] | None,
    stop: Callable[[], bool],
) -> bool:
    """Prefill `prompt`, polling `stop` before it and after each ubatch; False if it stopped,
    with the cells placed so far removed (the sequence holds its first n_past tokens again)."""

    def checked(done: int, total: int) -> None:
        if progress is not None:
            progress(done, total)
        if done < total and stop():
            raise _Stopped

    if stop():
        return False
    try:
        ctx.prefill(prompt, n_past, seq_id, progress=checked)
    except _Stopped:
        ctx.memory.seq_rm(seq_id, n_past, -1)
        return False
    return True
