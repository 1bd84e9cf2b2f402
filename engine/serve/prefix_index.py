"""Shared prefixes: every token sequence the cache holds, found by longest common prefix, and
reused from wherever it lives instead of being prefilled again.

The index is each slot's `cache` (the tokens its sequence's cells hold, by position, kept true
by the code that adds, removes and shifts those cells) plus the host tier's saved states
(engine/serve/host_cache.py). It is read, never copied, so it cannot go stale; a lookup scans
n_slots + host entries, each compared only while tokens agree. Only a slot's exact prefix
(`Slot.n_exact`: cells that equal a fresh prefill) is offered, so a reused prefix never changes
an answer.

Where a prefix is found decides what it costs:
- the slot's own cells: kept (llama-server's prompt cache);
- another sequence's cells in a unified cache (-kvu): `seq_cp`, the slot's sequence id joins
  those cells; nothing is computed or copied. A change to one sequence alone (context shift)
  separates it first (engine/kv/cache.py `separate`), and a cell is free when nobody holds it;
- another sequence's stream (per-slot streams): its K/V rows copied on the device;
- host memory (--cache-ram): the saved state restored into the slot's cells.

Under KV pressure (unified cache) idle sequences give up cells: first those only one idle
sequence holds, least recently used first, saved to host memory before they go; then idle
sequences whose cells no active sequence holds (the prefixes idle slots share) — never a cell
an active sequence holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from ubatch.engine.batch import common_prefix
from ubatch.engine.context.context import Context
from ubatch.engine.context.state import capture, restore, usable_prefix
from ubatch.engine.context.state_file import StateError
from ubatch.engine.kv.cache import NoCellsError
from ubatch.engine.serve.host_cache import HostCache, HostEntry, cut_state
from ubatch.engine.serve.prompt_cache import reuse_chunks
from ubatch.engine.serve.slot import Slot, SlotState
from ubatch.engine.serve.stats import PrefixReuse

WAIT_MIN_TOKENS = 32  # a launch waits for another slot's prompt only for a prefix this long
MIN_SHARED = 16  # tokens another source must add to the own prefix to be worth taking (vLLM's block)


class PrefixIndex:
    """The scheduler's view of what is cached, and the rules that reuse it."""

    def __init__(self, ctx: Context, slots: Sequence[Slot], host: HostCache, share: bool = True) -> None:
        self.ctx, self.slots, self.host, self.share = ctx, slots, host, share
        self.unified = ctx.memory.n_stream == 1
        self.n_swa = ctx.model.hparams.n_swa
        self.n_seq = ctx.cparams.n_seq_max
        self.min_shared = MIN_SHARED

    # -- lookups --------------------------------------------------------------------------------
    def _window_ok(self, seq_id: int, n: int) -> bool:
        """A sliding-window cache still holds the cells a token at position n must see."""
        return not (n > 0 and self.n_swa > 0 and self.ctx.memory.seq_pos_min(seq_id) > max(0, n - self.n_swa))

    def in_cells(self, prompt: list[int], exclude: Slot | None = None) -> tuple[Slot | None, int]:
        """The sequence whose exact cells share the longest prefix with `prompt`."""
        best, n_best = None, 0
        for o in self.slots:
            if o is exclude or not o.cache or not prompt or o.cache[0] != prompt[0]:
                continue
            n = common_prefix(o.cache[: o.n_exact], prompt)
            if n > n_best and self._window_ok(o.id, n):
                best, n_best = o, n
        return best, n_best

    def in_ram(self, prompt: list[int]) -> tuple[HostEntry | None, int]:
        return self.host.best(prompt) if self.host.enabled else (None, 0)

    def longest(self, prompt: list[int]) -> int:
        """The longest prefix of `prompt` cached anywhere (cells or host memory)."""
        return max(self.in_cells(prompt)[1], self.in_ram(prompt)[1])

    def should_wait(self, prompt: list[int]) -> bool:
        """A slot is reading a prompt that shares a long prefix with this one, beyond anything
        cached yet: launching now would compute that prefix twice; wait until it is in cells."""
        if not self.share or len(prompt) < WAIT_MIN_TOKENS:
            return False
        have = -1
        for o in self.slots:
            if o.state is not SlotState.PROCESSING_PROMPT or o.task is None:
                continue
            n = min(common_prefix(o.task.prompt, prompt), len(prompt) - 1)
            if n >= WAIT_MIN_TOKENS and n - len(o.cache) >= self.min_shared:
                if have < 0:
                    have = self.longest(prompt)
                if n - have >= self.min_shared:
                    return True
        return False

    # -- which slot ------------------------------------------------------------------------------
    def pick_slot(self, prompt: list[int], id_slot: int, similarity: float) -> Slot | None:
        """The requested slot; else the idle slot whose own cache shares the largest fraction of
        the prompt (above `similarity`, llama-server's rule); else, in a unified cache, the idle
        slot whose cells only it holds are fewest (what taking it would lose), least recently
        used first; else the least recently used. None when every slot is busy."""
        if id_slot >= 0:
            s = self.slots[id_slot]
            return None if s.busy else s
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        if similarity > 0 and prompt:
            best, best_sim = None, similarity
            for s in idle:
                sim = common_prefix(s.cache[: s.n_exact], prompt) / len(prompt)
                if s.cache and sim > best_sim:
                    best, best_sim = s, sim
            if best is not None:
                return best
        if self.share and self.unified:
            others = list(range(self.n_seq))
            return min(idle, key=lambda s: (self.ctx.memory.positions_apart(s.id, others).size, s.t_last_used))
        return min(idle, key=lambda s: s.t_last_used)

    # -- reuse -----------------------------------------------------------------------------------
    def reuse(self, s: Slot, prompt: list[int], cache_prompt: bool, cache_reuse: int) -> PrefixReuse:
        """Give slot `s` the longest cached prefix of `prompt` from its own cells, another
        sequence's or host memory; its other cells go (saved to host memory first when nobody
        else holds them). Sets `s.cache`; returns where the tokens came from."""
        mem = self.ctx.memory
        limit = len(prompt) - 1  # at least one token is evaluated, for its logits
        if not cache_prompt:
            self.save(s, 0)
            s.forget(mem)
            return PrefixReuse()
        n_own = min(common_prefix(s.cache[: s.n_exact], prompt), limit)
        if not self._window_ok(s.id, n_own):
            n_own = 0
        src, n_seq, entry, n_ram = None, 0, None, 0
        if self.share:
            src, n_seq = self.in_cells(prompt, exclude=s)
            n_seq = min(n_seq, limit)
            entry, n_ram = self.in_ram(prompt)
            n_ram = min(n_ram, limit)
        if src is not None and n_seq >= n_own + self.min_shared and n_seq >= n_ram:
            # unified: the whole prefix joins src's cells (the slot's own copy is freed); between
            # streams only what the slot lacks is copied, unless a window cache makes it whole
            start = 0 if self.unified or self.n_swa > 0 else n_own
            self.save(s, start)
            mem.seq_rm(s.id, start, -1)
            s.cut(start)
            if mem.can_seq_cp(src.id, s.id, start, n_seq):
                mem.seq_cp(src.id, s.id, start, n_seq)
                s.cache.extend(src.cache[start:n_seq])
                return PrefixReuse(n_own, n_seq - n_own, 0, src.id)
            n_own = min(n_own, start)
        if entry is not None and n_ram >= n_own + self.min_shared:
            got = self._restore(s, entry, n_ram)
            if got > n_own:
                return PrefixReuse(n_own, 0, got - n_own)
            n_own = min(n_own, len(s.cache))
        if cache_reuse:  # llama-server's --cache-reuse: chunks of the own cells moved into place
            n0 = common_prefix(s.cache, prompt)
            self.save(s, n0)
            n_past = reuse_chunks(mem, s.id, s.cache, prompt, n0, cache_reuse)
            if n_past == len(prompt):
                n_past -= 1
            if not self._window_ok(s.id, n_past):
                n_past = 0
            mem.seq_rm(s.id, n_past, -1)
            s.cut(n_past)
            if n_past > n0:  # moved cells were computed after other tokens: not exact
                s.taint = n0 if s.taint < 0 else min(s.taint, n0)
            return PrefixReuse(n_past)
        self.save(s, n_own)
        mem.seq_rm(s.id, n_own, -1)
        s.cut(n_own)
        return PrefixReuse(n_own)

    def _restore(self, s: Slot, entry: HostEntry, n: int) -> int:
        """Restore a host-memory state into the slot, cut to n tokens; 0 when it does not fit."""
        self.save(s, 0)
        try:
            restore(self.ctx, entry.state, s.id)
        except StateError:
            return 0
        s.cache[:] = entry.tokens
        s.taint = -1
        n = usable_prefix(self.ctx, s.id, n)
        self.ctx.memory.seq_rm(s.id, n, -1)
        s.cut(n)
        self.host.touch(entry)
        return n

    # -- host memory and eviction ----------------------------------------------------------------
    def save(self, s: Slot, keep: int) -> bool:
        """Before the slot's cells from position `keep` on go: keep its exact prefix in host
        memory when some of those cells hold tokens no other sequence holds."""
        n = s.n_exact
        if not self.host.enabled or n <= keep or self.host.holds(s.cache[:n]):
            return False
        apart = self.ctx.memory.positions_apart(s.id, list(range(self.n_seq)))
        if not (apart >= keep).any():
            return False
        state = cut_state(capture(self.ctx, s.id, s.cache), n)
        if self.n_swa > 0:  # the window's cells must still be there for a restore to be usable
            pos = state.tensors[f"c{len(self.ctx.memory.caches) - 1}.pos"]
            if pos.numel() == 0 or int(pos.min()) > max(0, n - self.n_swa):
                return False
        return self.host.put(state)

    def evict_idle(self) -> bool:
        """Free cells for the active sequences (unified cache); False when no idle cell can go."""
        if not self.unified:
            return False
        mem = self.ctx.memory
        idle = sorted((x for x in self.slots if not x.busy and x.cache), key=lambda x: x.t_last_used)
        everyone = list(range(self.n_seq))
        for x in idle:
            apart = mem.positions_apart(x.id, everyone)
            if apart.size:
                p = int(apart.min())
                self.save(x, p)
                mem.seq_rm(x.id, p, -1)
                x.cut(p)
                return True
        active = [x.id for x in self.slots if x.busy]
        for x in idle:
            if mem.positions_apart(x.id, active).size:
                x.forget(mem)
                return True
        return False

    def separate_for_shift(self, s: Slot) -> bool:
        """Before a context shift of `s`: give it its own copy of the cells it shares after
        n_keep, evicting idle cells for room; False when there is no room."""
        gen = s.gen
        if gen is None or not gen.params.ctx_shift or len(s.cache) + 1 < gen.n_ctx:
            return True
        n_keep = min(gen.params.n_keep, len(s.cache) - 1)
        while True:
            try:
                self.ctx.memory.separate(s.id, n_keep, -1)
                return True
            except NoCellsError:
                if not self.evict_idle():
                    return False
