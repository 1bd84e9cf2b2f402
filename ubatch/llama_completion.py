"""`Llama.create_completion`'s loop: llama-cpp-python's chunks from the engine's generation step.

The tokens come from the same `Generation` and the same decode step (engine/completion/complete.py
`decode_step`, speculative drafts included) as `ubatch cli`; what is particular to the Python API
is kept here: llama-cpp-python's chunk and logprobs shapes, and `Llama.input_ids` / `scores` /
`n_tokens` kept equal to what the context holds after every step. The loop sees `Llama` only as
a `CompletionHost` (what it reads and drives), so this module does not import ubatch/llama.py.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Protocol, TypedDict

import torch

from ubatch.engine.completion.complete import CompletionStats, check_prompt_fits, decode_step
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import Generation, GenerationParams, TokenProb
from ubatch.engine.grammar import Grammar
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.spec.draft import create_speculator
from ubatch.engine.spec.speculative import SpecError, SpecParams, SpecStats, Speculator
from ubatch.engine.vocab.vocab import Vocab


class Logprobs(TypedDict):
    """llama-cpp-python's `logprobs` of a choice: per token, its text, log-probability, top
    alternatives (text -> log-probability) and offset in the completion text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class Choice(TypedDict):
    text: str
    index: int
    logprobs: Logprobs | None
    finish_reason: str | None


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChunk(TypedDict):
    """A `text_completion` object: one streamed chunk, or the whole response."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class CompletionHost(Protocol):
    """What the loop reads and drives of `Llama`: its context and vocabulary, its speculator, and
    the evaluated tokens it keeps (llama-cpp-python's `input_ids` / `scores` / `n_tokens`)."""

    model_path: str
    ctx: Context
    vocab: Vocab
    speculator: Speculator | None
    spec_stats: SpecStats

    def prefix_eval(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """Evaluate `prompt`, reusing the longest common prefix; (the tokens now in the context,
        the logits row that predicts the next one)."""
        ...

    def after_step(self, cache: list[int], n_before: int, n_rows: int) -> None:
        """A generation step decoded rows n_before.. (the sampled token, then accepted drafts)."""
        ...


def speculator_for(spec: SpecParams, ctx: Context, draft_model: str | os.PathLike[str] | None) -> Speculator | None:
    """The Llama object's speculator (None when off); draft-simple loads `draft_model` into a
    context of its own with the target's sizes."""
    if not spec.enabled:
        return None
    dctx = None
    if "draft-simple" in spec.types:
        if draft_model is None:
            raise SpecError("spec_type draft-simple needs draft_model (a GGUF path)")
        cp = ctx.cparams
        dp = ContextParams(n_ctx=cp.n_ctx, n_batch=cp.n_batch, n_ubatch=cp.n_ubatch, n_seq_max=cp.n_seq_max)
        dctx = Context(Model.load(draft_model), replace(dp, n_outputs_max=cp.n_seq_max, backend=ctx.params.backend))
    return create_speculator(spec, ctx, dctx)


def logprobs_entry(prob: TokenProb, offset: int) -> Logprobs:
    """One token's entry of llama-cpp-python's `logprobs` (text pieces, not token ids)."""

    def text(piece: bytes) -> str:
        return piece.decode("utf-8", errors="replace")

    return {
        "tokens": [text(prob.piece)],
        "token_logprobs": [prob.logprob],
        "top_logprobs": [{text(p): lp for _, p, lp in prob.top}],
        "text_offset": [offset],
    }


def join_logprobs(parts: list[Logprobs]) -> Logprobs:
    """The chunks' logprobs as one (the non-streamed response's)."""
    return {
        "tokens": [x for p in parts for x in p["tokens"]],
        "token_logprobs": [x for p in parts for x in p["token_logprobs"]],
        "top_logprobs": [x for p in parts for x in p["top_logprobs"]],
        "text_offset": [x for p in parts for x in p["text_offset"]],
    }


def completion_chunks(
    llm: CompletionHost,
    prompt: str | list[int],
    max_tokens: int | None,
    sp: SamplerParams,
    logprobs: int | None,
    echo: bool,
    stop: str | list[str] | None,
    grammar: Grammar | None,
    logit_bias: list[tuple[int, float]],
) -> Iterator[CompletionChunk]:
    cid, created = f"cmpl-{uuid.uuid4()}", int(time.time())
    ctx, vocab = llm.ctx, llm.vocab
    ids = prompt if isinstance(prompt, list) else vocab.tokenize(prompt, True, True)
    check_prompt_fits(ctx, len(ids))
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    limit = -1 if max_tokens is None or max_tokens <= 0 else max_tokens  # -1: until the context is full
    sampler = Sampler(sp, ctx.cparams.n_ctx_seq, vocab)
    cache, last_logits = llm.prefix_eval(ids)
    n_gen, emitted = 0, 0

    def chunk(text: str, finish: str | None, lp: Logprobs | None = None) -> CompletionChunk:
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": llm.model_path,
            "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": n_gen, "total_tokens": len(ids) + n_gen},
        }

    if echo:
        yield chunk(vocab.detokenize(ids), None)
    params = GenerationParams(
        n_predict=limit,
        stop=stops,
        n_probs=0 if logprobs is None else max(logprobs, 1),
        grammar=grammar,
        logit_bias=logit_bias,
    )
    gen = Generation(vocab, sampler, params, ctx.n_ctx, cache)
    gen.accept_prompt(ids)
    stats = CompletionStats()
    pending = [gen.sample(last_logits)]
    while True:
        for step in pending:
            if gen.stop_reason == "eog" and step is pending[-1]:
                break
            n_gen += 1
            lp = None if step.prob is None else logprobs_entry(step.prob, emitted)
            if step.text or (lp and gen.stop_reason != "word"):
                emitted += len(step.text)
                yield chunk(step.text, None, lp)
        if gen.done:
            break
        n_before = len(cache)
        pending = decode_step(ctx, gen, 0, llm.speculator, stats)
        llm.after_step(cache, n_before, len(pending))
    llm.spec_stats.merge(stats.spec)
    tail = gen.finish()  # at the end of generation or length, what was held back is text after all
    if tail:
        yield chunk(tail, None)
    yield chunk("", "length" if gen.stop_reason in ("length", "context") else "stop")
