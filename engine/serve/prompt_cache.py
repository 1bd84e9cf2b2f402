"""llama-server's prompt cache: which idle slot a request goes to, and how much of the slot's
cached tokens it can keep (the common prefix, plus chunks moved into place with --cache-reuse).
Reusing cells is what makes a follow-up request prefill only what is new."""

from __future__ import annotations

from collections.abc import Sequence

from ubatch.engine.batch import common_prefix
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.serve.slot import Slot


def pick_slot(slots: Sequence[Slot], prompt: list[int], id_slot: int, similarity: float) -> Slot | None:
    """The requested slot, else the idle slot whose cache shares the largest fraction of the
    prompt (above `similarity`), else the least recently used idle slot; None when all are busy.
    An `id_slot` past the last slot is refused when the request is read (llama-server wraps it
    around, which silently runs the request on a slot nobody asked for)."""
    if id_slot >= 0:
        s = slots[id_slot]
        return None if s.busy else s
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    if similarity > 0 and prompt:
        best, best_sim = None, similarity
        for s in idle:
            sim = common_prefix(s.cache, prompt) / len(prompt)
            if s.cache and sim > best_sim:
                best, best_sim = s, sim
        if best is not None:
            return best
    return min(idle, key=lambda s: s.t_last_used)


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


def reuse_cache(mem: KVMemory, s: Slot, prompt: list[int], cache_prompt: bool, cache_reuse: int, n_swa: int) -> int:
    """Keep what the slot's cells can give the new prompt; returns n_past, the tokens kept.
    The cells after them are removed and `s.cache` is cut to match."""
    n_past = common_prefix(s.cache, prompt) if cache_prompt else 0
    if cache_prompt and cache_reuse:
        n_past = reuse_chunks(mem, s.id, s.cache, prompt, n_past, cache_reuse)
    if n_past == len(prompt):
        n_past -= 1  # evaluate at least one token to get logits
    if n_past > 0 and n_swa > 0 and mem.seq_pos_min(s.id) > max(0, n_past - n_swa):
        n_past = 0  # the sliding-window cache no longer holds what the suffix must see
    mem.seq_rm(s.id, n_past, -1)
    del s.cache[n_past:]
    return n_past


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
