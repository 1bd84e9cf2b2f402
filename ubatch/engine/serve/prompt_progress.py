"""A slot's prompt being read, chunk by chunk: the bookkeeping after each decoded chunk and
llama-server's `prompt_progress` events (`"return_progress": true` on a streamed request).

llama-server sends one progress event when a task starts on a slot (what the prompt cache
already holds) and one after every decode that carried a chunk of its prompt, the last one
before the first generated token. Kept out of the scheduler's loop so that loop stays about
batching: the runner advances a slot's prompt after each decode, the post-process reports it.
"""

from __future__ import annotations

import time

from ubatch.engine.serve.slot import Slot
from ubatch.engine.serve.stats import SchedulerStats
from ubatch.engine.serve.task import Progress

__all__ = ["Progress", "advance_prompt", "prompt_started", "report"]


def report(s: Slot) -> None:
    """Emit the slot's progress event when its task asked for them."""
    t = s.task
    if t is not None and t.params.stream and t.params.return_progress:
        ms = int((time.perf_counter() - s.t_start) * 1e3)
        t.emit(Progress(t, s.id, len(t.prompt), s.n_prompt_cache, len(s.cache), ms))


def prompt_started(s: Slot, stats: SchedulerStats) -> None:
    """A task took the slot with `s.n_prompt_cache` of its prompt already cached (`s.reuse`
    says from where)."""
    stats.prompt_reused(s.reuse)
    report(s)


def advance_prompt(s: Slot, n: int) -> None:
    """`n` more prompt tokens of the slot's task were decoded into its cells (the runner's
    bookkeeping; the post-process then `report`s them)."""
    assert s.task is not None
    prompt = s.task.prompt
    s.cache.extend(prompt[s.i_prompt : s.i_prompt + n])
    s.i_prompt += n
    s.n_prompt_done += n
