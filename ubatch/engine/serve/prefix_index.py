"""Shared prefixes: every token sequence the cache holds, found by longest common prefix, and
reused from wherever it lives instead of being prefilled again.

The index is two radix trees (engine/serve/radix_tree.py): one of the slots' cells, one of the
host tier's saved states (engine/serve/host_cache.py, which keeps its own tree true as entries
come and go). A lookup walks the prompt once down a tree: O(prompt length), however many slots
and host entries there are. The slots' tree holds each slot's exact prefix (`Slot.n_exact`:
cells that equal a fresh prefill), so a reused prefix never changes an answer. A slot's tokens
(`SlotTokens`) are changed by whoever adds, removes or shifts its cells (prefill, decode, a
context shift, seq_rm, slot reuse, a side runner); every change other than an append marks the
first position it touched, and before each lookup the tree cuts that slot's path back to the
mark (or to a shrunken exact prefix) and appends what is new: the work is what changed, and no
lookup ever sees a stale path.

Where a prefix is found decides what it costs:
- the slot's own cells: kept (llama-server's prompt cache);
- another sequence's cells in a unified cache (-kvu): `seq_cp`, the slot's sequence id joins
  those cells past the ones it already has (its own matching cells stay); nothing is computed
  or copied. A change to one sequence alone (context shift) separates it first
  (engine/kv/cache.py `separate`), and a cell is free when nobody holds it;
- another sequence's stream (per-slot streams): its K/V rows past the slot's own copied on the
  device;
- host memory (--cache-ram): the saved state restored into the slot's cells.
With a sliding window the take is partial too: the window cache takes the other sequence's
window cells (`KVMemory.seq_cp_past`), the full cache only the positions the slot lacks.

A prefix computed under some LoRA adapters (`Slot.lora`) is reused only by a request that applies
the same adapters at the same scales; states with adapters are never saved to host memory.

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
from ubatch.engine.serve.radix_tree import RadixTree
from ubatch.engine.serve.slot import Slot, SlotState
from ubatch.engine.serve.stats import PrefixReuse

WAIT_MIN_TOKENS = 32  # a launch waits for another slot's prompt only for a prefix this long
Lora = tuple[tuple[int, float], ...]  # the (adapter id, scale) pairs a prefix was computed under
MIN_SHARED = 16  # tokens another source must add to the own prefix to be worth taking (vLLM's block)


class PrefixIndex:
    """The scheduler's view of what is cached, and the rules that reuse it."""

    def __init__(self, ctx: Context, slots: Sequence[Slot], host: HostCache, share: bool = True) -> None:
        self.ctx, self.slots, self.host, self.share = ctx, slots, host, share
        self.unified = ctx.memory.n_stream == 1
        self.n_swa = ctx.model.hparams.n_swa
        self.n_seq = ctx.cparams.n_seq_max
        self.min_shared = MIN_SHARED
        self.cells: RadixTree[int] = RadixTree()  # slot id -> the slot's exact prefix
        for sl in slots:
            sl.saver = self.save  # side runners that take a slot's cells save its prefix first

    def sync(self) -> None:
        """Bring the slots' tree up to their tokens: each path cut back to the first position
        changed in place (or to the exact prefix, when it shrank), then extended with the new
        tokens."""
        for sl in self.slots:
            n, have = sl.n_exact, self.cells.length(sl.id)
            keep = min(have, sl.cache.take_changed(), n)
            if keep < have:
                self.cells.truncate(sl.id, keep)
            if n > keep:
                self.cells.extend(sl.id, sl.cache[keep:n])

    # -- lookups --------------------------------------------------------------------------------
    def _window_ok(self, seq_id: int, n: int) -> bool:
        """A sliding-window cache still holds the cells a token at position n must see."""
        return not (n > 0 and self.n_swa > 0 and self.ctx.memory.seq_pos_min(seq_id) > max(0, n - self.n_swa))

    def matches(self, prompt: list[int], lora: Lora = ()) -> dict[int, int]:
        """Slot id -> the tokens of `prompt` that slot's exact cells hold (slots sharing none,
        or whose cells were computed under other LoRA adapters, are left out)."""
        self.sync()
        return {i: n for i, n in self.cells.match_each(prompt).items() if self.slots[i].lora == lora}

    def in_cells(
        self, prompt: list[int], exclude: Slot | None = None, m: dict[int, int] | None = None, lora: Lora = ()
    ) -> tuple[Slot | None, int]:
        """The sequence whose exact cells share the longest prefix with `prompt` (`m`: its
        `matches`, when the caller has them)."""
        m = self.matches(prompt, lora) if m is None else m
        best, n_best = None, 0
        for o in self.slots:
            n = m.get(o.id, 0)
            if o is not exclude and n > n_best and self._window_ok(o.id, n):
                best, n_best = o, n
        return best, n_best

    def in_ram(self, prompt: list[int], lora: Lora = ()) -> tuple[HostEntry | None, int]:
        """The host entry sharing the longest prefix (host memory holds base-model states only)."""
        return self.host.best(prompt) if self.host.enabled and not lora else (None, 0)

    def longest(self, prompt: list[int], lora: Lora = ()) -> int:
        """The longest prefix of `prompt` cached anywhere (cells or host memory)."""
        return max(self.in_cells(prompt, lora=lora)[1], self.in_ram(prompt, lora)[1])

    def should_wait(self, prompt: list[int], lora: Lora = ()) -> bool:
        """A slot is reading a prompt that shares a long prefix with this one, beyond anything
        cached yet: launching now would compute that prefix twice; wait until it is in cells."""
        if not self.share or len(prompt) < WAIT_MIN_TOKENS:
            return False
        have = -1
        for o in self.slots:
            if o.state is not SlotState.PROCESSING_PROMPT or o.task is None or o.lora != lora:
                continue
            n = min(common_prefix(o.task.prompt, prompt), len(prompt) - 1)
            if n >= WAIT_MIN_TOKENS and n - len(o.cache) >= self.min_shared:
                if have < 0:
                    have = self.longest(prompt, lora)
                if n - have >= self.min_shared:
                    return True
        return False

    # -- which slot ------------------------------------------------------------------------------
    def pick_slot(self, prompt: list[int], id_slot: int, similarity: float, lora: Lora = ()) -> Slot | None:
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
            m = self.matches(prompt, lora)
            for s in idle:
                sim = m.get(s.id, 0) / len(prompt)
                if s.cache and sim > best_sim:
                    best, best_sim = s, sim
            if best is not None:
                return best
        if self.share and self.unified:
            others = list(range(self.n_seq))
            return min(idle, key=lambda s: (self.ctx.memory.positions_apart(s.id, others).size, s.t_last_used))
        return min(idle, key=lambda s: s.t_last_used)

    # -- reuse -----------------------------------------------------------------------------------
    def reuse(self, s: Slot, prompt: list[int], cache_prompt: bool, cache_reuse: int, lora: Lora = ()) -> PrefixReuse:
        """Give slot `s` the longest cached prefix of `prompt` computed under the LoRA adapters
        `lora`, from its own cells, another sequence's or host memory; its other cells go (saved
        to host memory first when nobody else holds them). Sets `s.cache` and `s.lora`; returns
        where the tokens came from."""
        got = self._reuse(s, prompt, cache_prompt, cache_reuse, lora)
        s.lora = lora
        return got

    def _reuse(self, s: Slot, prompt: list[int], cache_prompt: bool, cache_reuse: int, lora: Lora) -> PrefixReuse:
        mem = self.ctx.memory
        limit = len(prompt) - 1  # at least one token is evaluated, for its logits
        if not cache_prompt:
            self.save(s, 0)
            s.forget(mem)
            return PrefixReuse()
        m = self.matches(prompt, lora)
        n_own = min(m.get(s.id, 0), limit) if s.lora == lora else 0
        if not self._window_ok(s.id, n_own):
            n_own = 0
        src, n_seq, entry, n_ram = None, 0, None, 0
        if self.share:
            src, n_seq = self.in_cells(prompt, exclude=s, m=m)
            n_seq = min(n_seq, limit)
            entry, n_ram = self.in_ram(prompt, lora)
            n_ram = min(n_ram, limit)
        if src is not None and n_seq >= n_own + self.min_shared and n_seq >= n_ram:
            # the slot keeps its own n_own cells and takes only what it lacks: src's cells over
            # [n_own, n_seq) (in a window cache, src's window cells: KVMemory.seq_cp_past)
            self.save(s, n_own)
            mem.seq_rm(s.id, n_own, -1)
            s.cut(n_own)
            if mem.can_seq_cp_past(src.id, s.id, n_own, n_seq):
                mem.seq_cp_past(src.id, s.id, n_own, n_seq)
                s.cache.extend(src.cache[n_own:n_seq])
                return PrefixReuse(n_own, n_seq - n_own, 0, src.id)
        if entry is not None and n_ram >= n_own + self.min_shared:
            got = self._restore(s, entry, n_ram)
            if got > n_own:
                return PrefixReuse(n_own, 0, got - n_own)
            n_own = min(n_own, len(s.cache))
        if cache_reuse and s.lora == lora:  # llama-server's --cache-reuse: chunks of the own cells moved into place
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
        if not self.host.enabled or s.lora or n <= keep or self.host.holds(s.cache[:n]):
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
