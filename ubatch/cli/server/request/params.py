"""llama-server's request schema: a native JSON body read into the engine's `TaskParams`.

Reading a body is an HTTP concern, so it lives here rather than in the engine. Each field is
checked the way server-schema.cpp checks it, so a bad field is the same 400 message llama-server
sends, and JSON null means "use the server's default".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ubatch.cli.server.http import bad_request, type_name
from ubatch.cli.server.request.grammar import request_grammar
from ubatch.cli.server.request.sampling import get_breakers, get_samplers
from ubatch.engine.generation.generation import N_PROBS_MAX
from ubatch.engine.grammar import Grammar
from ubatch.engine.sampling.chain import LLAMA_DEFAULT_SEED, SamplerParams
from ubatch.engine.serve.task import INT32_MAX, TaskParams
from ubatch.engine.vocab.vocab import Vocab


def _present(body: dict[str, Any], *keys: str) -> tuple[str, Any] | None:
    """The first key present with a non-null value (JSON null means 'use the default')."""
    for k in keys:
        if body.get(k) is not None:
            return k, body[k]
    return None


def get_int(
    body: dict[str, Any], keys: tuple[str, ...] | str, default: int, lo: int | None = None, hi: int | None = None
) -> int:
    """An integer field with a hard limit: out of range is a 400, as server-schema.cpp."""
    hit = _present(body, *((keys,) if isinstance(keys, str) else keys))
    if hit is None:
        return default
    k, v = hit
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad_request(f"Field '{k}': expected an integer, got {type_name(v)}")
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise bad_request(f"Field '{k}': expected an integer, got {v}")
        v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"Field '{k}': Value must be between {lo} <= value <= {hi}, but got {v}")
    return v


def get_float(
    body: dict[str, Any], key: str, default: float, lo: float | None = None, hi: float | None = None
) -> float:
    """A number field with a soft limit: clamped silently."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad_request(f"Field '{key}': expected a number, got {type_name(v) if not isinstance(v, float) else v}")
    v = float(v)
    if lo is not None:
        v = max(lo, v)
    if hi is not None:
        v = min(hi, v)
    return v


def get_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"Field '{key}': expected a boolean, got {type_name(v)}")
    return v


def get_stop(body: dict[str, Any], default: list[str]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return list(default)
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("Field 'stop': expected a string or an array of strings")
    return [s for s in v if s] or list(default)


@dataclass(slots=True)
class ServerDefaults:
    """Server-wide values a request falls back to (llama-server's CLI flags)."""

    sampling: SamplerParams = field(default_factory=SamplerParams)
    n_predict: int = -1
    n_ctx_slot: int = 0
    n_parallel: int = 1
    n_vocab: int = 0
    cache_prompt: bool = True
    n_cache_reuse: int = 0
    stop: list[str] = field(default_factory=list)
    grammar: Grammar | None = None  # --grammar / --json-schema, compiled once
    n_keep: int = 0  # --keep
    special: bool = False  # -sp: control tokens appear in the text
    vocab: Vocab | None = None  # the model's: a reasoning budget's tags are tokenized with it
    n_lora: int = 0  # LoRA adapters loaded: the ids a request's `lora` may name


def get_lora(v: Any, n_lora: int, field: str = "lora") -> dict[int, float]:
    """llama-server's parse_lora_request: [{id, scale}] -> {id: scale} (scale 0 when absent);
    an id that names no loaded adapter is refused in one line."""
    if not isinstance(v, list):
        raise bad_request(f"Field '{field}': expected an array of objects with 'id' and 'scale' fields")
    out: dict[int, float] = {}
    for e in v:
        if not isinstance(e, dict):
            raise bad_request(f"Field '{field}': expected an array of objects with 'id' and 'scale' fields")
        i = get_int(e, "id", -1, None, None)
        if not 0 <= i < n_lora:
            raise bad_request(f"Field '{field}': no LoRA adapter has id {i} ({n_lora} loaded; see GET /lora-adapters)")
        out[i] = get_float(e, "scale", 0.0)
    return out


def parse_params(
    body: dict[str, Any],
    d: ServerDefaults,
    tokenize: Callable[[str], list[int]] | None = None,
    eog: frozenset[int] = frozenset(),
) -> TaskParams:
    """params_from_json_cmpl: a native request body -> TaskParams (a 400 on bad input)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    ds = d.sampling
    seed = get_int(body, "seed", -1 if ds.seed == LLAMA_DEFAULT_SEED else ds.seed, -1, 0xFFFFFFFF)
    # a request may not send -1 (llama-server's hard limits); a server default of -1 is the slot
    last_n = get_int(body, "repeat_last_n", ds.repeat_last_n, 0, INT32_MAX)
    dry_last_n = get_int(body, "dry_penalty_last_n", ds.dry_penalty_last_n, 0, INT32_MAX)
    dry_base = get_float(body, "dry_base", ds.dry_base)
    sp = SamplerParams(
        temp=get_float(body, "temperature", ds.temp, 0.0),
        top_k=max(0, get_int(body, "top_k", ds.top_k, None, None)),
        top_p=get_float(body, "top_p", ds.top_p, 0.0, 1.0),
        min_p=get_float(body, "min_p", ds.min_p, 0.0, 1.0),
        min_keep=get_int(body, "min_keep", ds.min_keep, 0, INT32_MAX),
        seed=LLAMA_DEFAULT_SEED if seed in (-1, LLAMA_DEFAULT_SEED) else seed,
        repeat_penalty=get_float(body, "repeat_penalty", ds.repeat_penalty),
        repeat_last_n=d.n_ctx_slot if last_n == -1 else last_n,
        frequency_penalty=get_float(body, "frequency_penalty", ds.frequency_penalty),
        presence_penalty=get_float(body, "presence_penalty", ds.presence_penalty),
        typ_p=get_float(body, "typical_p", ds.typ_p),
        top_n_sigma=get_float(body, "top_n_sigma", ds.top_n_sigma),
        xtc_probability=get_float(body, "xtc_probability", ds.xtc_probability, 0.0, 1.0),
        xtc_threshold=get_float(body, "xtc_threshold", ds.xtc_threshold, 0.0, 1.0),
        dynatemp_range=get_float(body, "dynatemp_range", ds.dynatemp_range),
        dynatemp_exponent=get_float(body, "dynatemp_exponent", ds.dynatemp_exponent),
        mirostat=min(2, max(0, get_int(body, "mirostat", ds.mirostat))),
        mirostat_tau=get_float(body, "mirostat_tau", ds.mirostat_tau),
        mirostat_eta=get_float(body, "mirostat_eta", ds.mirostat_eta),
        dry_multiplier=get_float(body, "dry_multiplier", ds.dry_multiplier),
        dry_base=ds.dry_base if dry_base < 1.0 else dry_base,  # below 1: the server's default
        dry_allowed_length=get_int(body, "dry_allowed_length", ds.dry_allowed_length, 0, INT32_MAX),
        dry_penalty_last_n=d.n_ctx_slot if dry_last_n == -1 else dry_last_n,
        dry_sequence_breakers=get_breakers(body, ds.dry_sequence_breakers),
        samplers=get_samplers(body, ds.samplers),
    )
    _reasoning_budget(body, sp, ds, d.vocab)
    n_probs = get_int(body, "n_probs", 0, 0, INT32_MAX)
    if n_probs == 0 and isinstance(body.get("logprobs"), int) and not isinstance(body["logprobs"], bool):
        n_probs = get_int(body, "logprobs", 0, 0, INT32_MAX)
    n_probs = min(n_probs, N_PROBS_MAX, d.n_vocab or N_PROBS_MAX)  # silently, as llama.cpp clamps to the vocab
    stream_opts = body.get("stream_options")
    if stream_opts is not None and not isinstance(stream_opts, dict):
        raise bad_request("Field 'stream_options': expected an object")
    p = TaskParams(
        n_predict=get_int(body, ("n_predict", "max_completion_tokens", "max_tokens"), d.n_predict, -1, INT32_MAX),
        sampling=sp,
        stop=get_stop(body, d.stop),
        n_probs=n_probs,
        post_sampling_probs=get_bool(body, "post_sampling_probs", False),
        ignore_eos=get_bool(body, "ignore_eos", False),
        stream=get_bool(body, "stream", False),
        include_usage=get_bool(stream_opts or {}, "include_usage", False),
        cache_prompt=get_bool(body, "cache_prompt", d.cache_prompt),
        id_slot=get_int(body, "id_slot", -1, -1, max(d.n_parallel, 1) - 1),
        n_keep=get_int(body, "n_keep", d.n_keep, -1, INT32_MAX),
        special=d.special,
        n_discard=get_int(body, "n_discard", 0, 0, INT32_MAX),
        n_cache_reuse=get_int(body, "n_cache_reuse", d.n_cache_reuse, 0, INT32_MAX),
        n_cmpl=get_int(body, ("n_cmpl", "n"), 1, 1, max(1, d.n_parallel)),
        return_tokens=get_bool(body, "return_tokens", False),
        timings_per_token=get_bool(body, "timings_per_token", False),
        return_progress=get_bool(body, "return_progress", False),
        verbose=get_bool(body, "verbose", False),
        lora=get_lora(body["lora"], d.n_lora) if body.get("lora") is not None else None,
    )
    p.logit_bias = _logit_bias(body.get("logit_bias"), d.n_vocab, tokenize)
    if p.ignore_eos:  # as llama-server: the end-of-generation tokens get -inf, and the echo shows it
        p.logit_bias += [(t, -math.inf) for t in sorted(eog)]
    p.grammar = request_grammar(body, d.grammar)
    return p


def _str(body: dict[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"Field '{key}': expected a string, got {type_name(v)}")
    return v


def _reasoning_budget(body: dict[str, Any], sp: SamplerParams, ds: SamplerParams, vocab: Vocab | None) -> None:
    """server-schema.cpp's reasoning budget fields: the budget, the thinking start tag, the end
    tags (the first is forced), the message forced before it, and the generation prompt the
    budget is primed with. A chat writes them from its template (cli/server/request/chat.py);
    a native body may send them itself."""
    sp.reasoning_budget_tokens = get_int(body, "reasoning_budget_tokens", ds.reasoning_budget_tokens, -1, INT32_MAX)
    sp.reasoning_budget_message = ds.reasoning_budget_message
    if vocab is None:
        return

    def tokens(text: str) -> tuple[int, ...]:
        return tuple(vocab.tokenize(text, False, True))

    start = _str(body, "reasoning_budget_start_tag")
    if start is not None:
        sp.reasoning_budget_start = tokens(start)
    ends = body.get("reasoning_budget_end_tags")
    if ends is None and body.get("reasoning_budget_end_tag") is not None:
        ends = [_str(body, "reasoning_budget_end_tag")]
    if ends is not None:
        if not isinstance(ends, list) or not all(isinstance(t, str) for t in ends):
            raise bad_request("Field 'reasoning_budget_end_tags': expected an array of strings")
        sp.reasoning_budget_end = tuple(tokens(t) for t in ends if t)
    message = _str(body, "reasoning_budget_message")
    if message is not None and sp.reasoning_budget_end:  # forced: the message, then the first end tag
        sp.reasoning_budget_message = message
        sp.reasoning_budget_forced = (tokens(message) if message else ()) + sp.reasoning_budget_end[0]
    prompt = _str(body, "generation_prompt")
    if prompt:
        ids = tokens(prompt)
        # a tokenizer that puts a space before the first token: that token is not the prompt's
        if ids and vocab.token_to_piece(ids[0], True)[:1].isspace() and not prompt[:1].isspace():
            ids = ids[1:]
        sp.reasoning_budget_prefill = ids


MAX_LOGIT_BIAS = 1 << 16  # entries (or the vocabulary's size, if larger): texts may name any number of tokens


def _logit_bias(v: Any, n_vocab: int, tokenize: Callable[[str], list[int]] | None) -> list[tuple[int, float]]:
    """llama-server's two forms: [[token|text, bias|false], ...] or {"token": bias}."""
    if v is None:
        return []
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list):
        items = [tuple(e) for e in v if isinstance(e, list) and len(e) == 2]
    else:
        raise bad_request("Field 'logit_bias': expected an object or an array of [token, bias] pairs")
    if len(items) > max(n_vocab, MAX_LOGIT_BIAS):  # each entry is applied to every sampled token's logits
        raise bad_request(
            f"Field 'logit_bias': {len(items)} entries, more than {max(n_vocab, MAX_LOGIT_BIAS)}"
            f" (the model has {n_vocab} tokens); give each token once"
        )
    out: list[tuple[int, float]] = []
    for key, bias in items:
        if bias is False:
            b = -math.inf
        elif isinstance(bias, int | float) and not isinstance(bias, bool):
            b = float(bias)
        else:
            continue
        if isinstance(key, str) and key.lstrip("-").isdigit():
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool):
            if 0 <= key < n_vocab:
                out.append((key, b))
        elif isinstance(key, str) and tokenize is not None:
            out.extend((t, b) for t in tokenize(key))
    return out


# -- prompts (tokenize_input_prompts) ----------------------------------------------------------


PROMPT_ELEMENTS = (
    "elements must be a string, a list of tokens, a JSON object containing a prompt string,"
    " or a list of mixed strings & tokens."
)


MAX_PROMPTS = 2048  # prompts in one request (OpenAI's limit on an embeddings input array)


def split_prompts(prompt: Any, name: str = "prompt") -> list[list[str | int]]:
    """llama.cpp's tokenize_input_prompts: an array holding no token id is several prompts (one
    task each), anything else is one prompt. A prompt is a string, an array of token ids, an
    array mixing strings and token ids, or {"prompt_string": one of those}. At most MAX_PROMPTS:
    a 64 MiB body of short strings is millions of tasks (minutes of CPU before any answer)."""
    if isinstance(prompt, list) and not any(_is_int(x) for x in prompt):
        if not prompt:
            raise bad_request(f'"{name}" must not be empty')
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(
                f'"{name}" holds {len(prompt)} prompts, more than {MAX_PROMPTS} in one request; send them in several'
            )
        return [_subprompt(p, name) for p in prompt]
    return [_subprompt(prompt, name)]


def _subprompt(p: Any, name: str) -> list[str | int]:
    if isinstance(p, dict) and "prompt_string" in p:
        p = p["prompt_string"]
        if isinstance(p, list) and all(isinstance(x, str) or _is_int(x) for x in p):
            return list(p)  # tokenize_mixed takes any array of strings and token ids here
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and all(isinstance(x, str) or _is_int(x) for x in p):
        if any(_is_int(x) for x in p) or not p:  # token ids, or strings mixed with token ids
            return list(p)
    raise bad_request(f'"{name}" {PROMPT_ELEMENTS}')


def mixed_parts(content: Any, name: str) -> list[str | int]:
    """llama.cpp's tokenize_mixed input (/tokenize "content"): a string, or an array of strings
    and token ids tokenized in order (BOS only before a leading string)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list) and all(isinstance(x, str) or _is_int(x) for x in content):
        return list(content)
    raise bad_request(f"Field '{name}': expected a string or an array of strings and token ids")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
