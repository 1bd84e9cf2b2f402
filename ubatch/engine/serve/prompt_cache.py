"""llama-server's prompt cache rules that engine/serve/prefix_index.py applies: dropping an idle
slot's prompt when a unified cache is full, and moving chunks of a slot's cells into place with
--cache-reuse. Reusing cells is what makes a follow-up request prefill only what is new."""

from __future__ import annotations

from collections.abc import Sequence

from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.serve.slot import Slot


def purge_idle(slots: Sequence[Slot], memory: KVMemory, unified: bool) -> bool:
    """No room left in a unified KV cache: drop the largest idle slot's cached prompt, as
    llama-server does (saved to host memory first, when it can be); False when there is none
    (or every slot has a stream of its own)."""
    idle = [s for s in slots if not s.busy and s.cache] if unified else []
    if not idle:
        return False
    s = max(idle, key=lambda s: len(s.cache))
    s.prompt_save()
    s.forget(memory)
    return True


def reuse_chunks(mem: KVMemory, seq_id: int, cache: list[int], prompt: list[int], n_past: int, min_chunk: int) -> int:
    """--cache-reuse: move matching chunks of the old cache into place with a K-shift."""
    head_c = head_p = n_past
    while head_c < len(cache) and head_p < len(prompt):
        n = 0
        while head_c + n < len(cache) and head_p + n < len(prompt) and cache[head_c + n] == prompt[head_p + n]:
            n += 1
        if n >= min_chunk:
            shift = head_p - head_c
            mem.seq_rm(seq_id, head_p, head_c)
            mem.seq_add(seq_id, head_c, head_c + n, shift)
            cache[head_p : head_p + n] = cache[head_c : head_c + n]
            n_past += n
            head_c += n
            head_p += n
        else:
            head_c += 1
    del cache[n_past:]
    return n_past
