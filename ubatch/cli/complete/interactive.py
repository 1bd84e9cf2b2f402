"""llama-completion's raw-text interactive mode (`ubatch cli -i`, `-if`): no chat template. The
model continues the text until an end-of-generation token, a reverse prompt (-r) or -n tokens;
then what you type (between --in-prefix and --in-suffix, with its newline) is appended and it
continues. At an end-of-generation token the first reverse prompt is inserted, as llama.cpp does.
A line ending in a backslash continues on the next one (with -mli the other way round: lines join
until one ends in a backslash). End of input (Ctrl-D) ends the session.
"""

from __future__ import annotations

import sys
from typing import Protocol, TextIO

from ubatch.cli.present import INPUT_COLOUR, RESET
from ubatch.engine.completion.complete import CompletionStats, complete
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.sampling.chain import Sampler
from ubatch.engine.spec.speculative import Speculator


class InteractiveFlags(Protocol):
    """The flags the loop reads (cli/complete/run.py's Run has them)."""

    interactive_first: bool
    in_prefix: str
    in_suffix: str
    multiline_input: bool
    reverse_prompts: list[str]


def read_input(src: TextIO, multiline: bool) -> str | None:
    """One input, with its newline. None at the end of input."""
    parts: list[str] = []
    while line := src.readline():
        body = line.rstrip("\n")
        marked = body.endswith("\\")
        parts.append(body.removesuffix("\\") + "\n")
        if marked != multiline:  # a backslash continues, or (-mli) ends the input
            return "".join(parts)
    return "".join(parts) if parts else None


def _add(total: CompletionStats, st: CompletionStats) -> None:
    total.n_prompt += st.n_prompt
    total.t_prompt_ms += st.t_prompt_ms
    total.n_gen += st.n_gen
    total.n_eval += st.n_eval
    total.n_eval_calls += st.n_eval_calls
    total.t_eval_ms += st.t_eval_ms
    total.t_sample_ms += st.t_sample_ms
    total.n_shifts += st.n_shifts
    total.spec.merge(st.spec)
    total.n_past, total.stop_reason, total.stopping_word = st.n_past, st.stop_reason, st.stopping_word


def interact(
    r: InteractiveFlags,
    ctx: Context,
    sampler: Sampler,
    ids: list[int],
    total: CompletionStats,
    params: GenerationParams,
    colour: bool = False,
    speculator: Speculator | None = None,
) -> None:
    """The loop; each round generates as `params` asks, and `total` collects every round's counts
    for the summary. With `colour`, what you type shows green (the terminal echoes it in the
    colour set before reading)."""
    vocab, out = ctx.model.vocab, sys.stdout
    cache: list[int] = []
    pending = ids
    waiting = r.interactive_first or not ids
    while True:
        if waiting:
            if r.in_prefix:
                out.write(r.in_prefix)
            out.write(INPUT_COLOUR if colour else "")
            out.flush()
            text = read_input(sys.stdin, r.multiline_input)
            out.write(RESET if colour else "")
            if text is None:
                break
            if r.in_suffix:
                out.write(r.in_suffix)
            pending = pending + vocab.tokenize(
                r.in_prefix + text + r.in_suffix, add_special=not cache and not pending, parse_special=False
            )
        if not pending:
            waiting = True
            continue
        st = CompletionStats()
        events = complete(ctx, pending, sampler, params, st, cache=cache, speculator=speculator)
        last = -1
        for ev in events:
            last = ev.token
            if ev.text:
                out.write(ev.text)
                out.flush()
        _add(total, st)
        # the token that ended a round by length or reverse prompt was sampled, not decoded yet
        pending, waiting = ([last] if st.stop_reason in ("word", "length") and last >= 0 else []), True
        if st.stop_reason == "word":
            out.write(st.stopping_word)  # shown, and already in the cache as generated
        elif st.stop_reason == "eog" and r.reverse_prompts:  # llama.cpp inserts the first reverse prompt
            out.write(r.reverse_prompts[0])
            pending = vocab.tokenize(r.reverse_prompts[0], add_special=False, parse_special=True)
        elif st.stop_reason == "context":
            break
        out.flush()
