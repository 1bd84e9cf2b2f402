"""The prefix index's structures on their own (engine/serve/radix_tree.py, engine/serve/slot.py
`SlotTokens`, engine/serve/host_cache.py): every answer checked against a brute-force scan of
the same sequences, and the tree's shape checked after every change, under random operations
that make runs split, merge, grow in place and vanish."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ubatch.engine.batch import common_prefix
from ubatch.engine.context.context import Context
from ubatch.engine.context.state_file import SeqState
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.serve.host_cache import HostCache
from ubatch.engine.serve.radix_tree import RadixNode, RadixTree, run_prefix
from ubatch.engine.serve.scheduler import Scheduler
from ubatch.engine.serve.slot import SlotTokens


def check_shape(tree: RadixTree[int], want: dict[int, list[int]]) -> None:
    """Every holder's path spells its tokens; a node's holders are those ending there plus its
    children's; runs are non-empty, keyed by their first token, with depths that add up; no
    node is empty or (without an ending holder) a mere link to one child."""
    assert len(tree) == len(want)
    for k, toks in want.items():
        assert tree.tokens(k) == toks and tree.length(k) == len(toks)

    def visit(node: RadixNode[int]) -> set[int]:
        below: set[int] = set(node.ends)
        for first, child in node.children.items():
            assert child.parent is node and child.edge and child.edge[0] == first
            assert child.depth == node.depth + len(child.edge)
            below |= visit(child)
        if node is not tree.root:
            assert set(node.holders) == below and below, "holders must be the ends below"
            assert node.ends or len(node.children) != 1, "an unmerged link node"
            for k in node.ends:
                assert len(want[k]) == node.depth
        return below

    assert visit(tree.root) == set(want)


def brute_longest(want: dict[int, list[int]], prompt: list[int]) -> int:
    return max((common_prefix(t, prompt) for t in want.values()), default=0)


def test_runs_split_merge_and_answer_prefix_queries() -> None:
    t: RadixTree[int] = RadixTree()
    t.insert(1, [1, 2, 3, 4, 5])
    t.insert(2, [1, 2, 3, 9])
    t.insert(3, [1, 2])
    want = {1: [1, 2, 3, 4, 5], 2: [1, 2, 3, 9], 3: [1, 2]}
    check_shape(t, want)
    assert t.longest([1, 2, 3, 4, 7]) == (1, 4)
    assert t.longest([1, 2, 3, 9, 9])[1] == 4
    assert t.longest([7]) == (None, 0)
    assert t.match_each([1, 2, 3, 4]) == {1: 4, 2: 3, 3: 2}
    assert t.within([1, 2, 3, 9, 9]) == [3, 2]  # shortest first
    t.truncate(1, 3)  # ends inside the shared run [1, 2, 3]
    want[1] = [1, 2, 3]
    check_shape(t, want)
    t.remove(2)  # the node at [1, 2, 3] now only links 3's end to 1's
    del want[2]
    check_shape(t, want)
    t.extend(1, [6, 6])  # a leaf of its own grows in place
    want[1] = [1, 2, 3, 6, 6]
    check_shape(t, want)
    t.extend(3, [3, 6, 7])  # follows 1's run, then leaves it
    want[3] = [1, 2, 3, 6, 7]
    check_shape(t, want)
    assert t.within([1, 2, 3, 6, 6, 1]) == [1]
    t.truncate(3, 0)
    t.truncate(1, 0)
    assert len(t) == 0 and not t.root.children


def test_run_prefix_agrees_with_a_token_by_token_scan() -> None:
    rng = np.random.default_rng(1)
    for _ in range(500):
        n = int(rng.integers(0, 3000))
        a = rng.integers(0, 3, n).tolist()
        b = list(a) if rng.random() < 0.5 else rng.integers(0, 3, int(rng.integers(0, 3000))).tolist()
        if b and rng.random() < 0.7:
            b[int(rng.integers(len(b)))] = 5
        off = int(rng.integers(0, 4))
        b = [9] * off + b
        assert run_prefix(a, b, off) == common_prefix(a, b[off:])


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_a_brute_force_scan(seed: int) -> None:
    """Insert, extend, truncate and remove on few tokens (so runs collide often); after each,
    the shape holds and longest / match_each / within answer as a scan of every sequence."""
    rng = np.random.default_rng(seed)
    tree: RadixTree[int] = RadixTree()
    want: dict[int, list[int]] = {}
    bases = [rng.integers(0, 4, 40).tolist() for _ in range(3)]

    def some_tokens() -> list[int]:
        base = bases[int(rng.integers(len(bases)))]
        cut = int(rng.integers(0, len(base) + 1))
        return base[:cut] + rng.integers(0, 4, int(rng.integers(0, 12))).tolist()

    for _ in range(600):
        op, k = rng.random(), int(rng.integers(0, 12))
        if op < 0.35:
            toks = some_tokens()
            tree.insert(k, toks)
            want.pop(k, None)
            if toks:
                want[k] = toks
        elif op < 0.6:
            more = rng.integers(0, 4, int(rng.integers(0, 6))).tolist()
            tree.extend(k, more)
            if want.get(k, []) + more:
                want[k] = want.get(k, []) + more
        elif op < 0.9:
            n = int(rng.integers(0, 50))
            tree.truncate(k, n)
            if k in want:
                want[k] = want[k][:n]
                if not want[k]:
                    del want[k]
        else:
            tree.remove(k)
            want.pop(k, None)
        check_shape(tree, want)
        for _ in range(3):
            p = some_tokens()
            key, n = tree.longest(p)
            assert n == brute_longest(want, p)
            assert key is None if n == 0 else common_prefix(want[key], p) == n
            each = {h: common_prefix(t, p) for h, t in want.items()}
            assert tree.match_each(p) == {h: n for h, n in each.items() if n > 0}
            inside = [h for h, t in want.items() if len(t) <= len(p) and p[: len(t)] == t]
            assert sorted(tree.within(p)) == sorted(inside)


# -- SlotTokens: what marks a change ------------------------------------------------------------
def test_slot_tokens_mark_the_first_position_changed_in_place_and_never_an_append() -> None:
    t = SlotTokens(range(10))
    assert t.take_changed() == 0  # a new list is new from position 0
    t.append(10)
    t.extend([11, 12])
    t += [13]
    assert t.take_changed() > len(t)
    cases = [
        (lambda x: x.__delitem__(slice(7, None)), 7),
        (lambda x: x.__delitem__(-2), 12),
        (lambda x: x.__setitem__(slice(3, 5), [9, 9, 9]), 3),
        (lambda x: x.__setitem__(slice(None, None, -3), list(range(5))), 1),
        (lambda x: x.__setitem__(4, 0), 4),
        (lambda x: x.insert(-1, 5), 13),
        (lambda x: x.pop(), 13),
        (lambda x: x.remove(6), 6),
        (lambda x: x.clear(), 0),
        (lambda x: x.reverse(), 0),
        (lambda x: x.sort(), 0),
        (lambda x: x.__imul__(0), 0),
    ]
    for change, pos in cases:
        t = SlotTokens(range(14))
        t.take_changed()
        before = list(t)
        change(t)
        assert t.take_changed() == pos
        assert before[:pos] == list(t)[:pos]


def test_host_cache_finds_entries_through_its_tree() -> None:
    """put / holds / best against a scan of the entries; an entry a new state extends goes;
    the least recently used go first at the limit; touch keeps one."""
    rng = np.random.default_rng(7)

    def state(tokens: list[int]) -> SeqState:
        rows = torch.zeros(len(tokens), 1024, dtype=torch.uint8)  # 1 KiB per token
        return SeqState({}, tokens, {"c0.pos": torch.arange(len(tokens)), "c0.k": rows})

    cache = HostCache(limit_mib=1)
    for _ in range(300):
        toks = [2, *rng.integers(0, 3, int(rng.integers(1, 200))).tolist()]
        if rng.random() < 0.3 and cache.entries:
            keys = list(cache.entries)
            cache.touch(cache.entries[keys[int(rng.integers(len(keys)))]])
        before = dict(cache.entries)
        held = any(e.tokens[: len(toks)] == toks for e in before.values())
        assert cache.holds(toks) == held
        put = cache.put(state(toks))
        assert put != held
        if put:  # the new entry is the last; none of the others is a prefix of it
            *others, new = cache.entries.values()
            assert new.tokens == toks
            assert not any(len(e.tokens) <= len(toks) and toks[: len(e.tokens)] == e.tokens for e in others)
        assert cache.nbytes == sum(e.nbytes for e in cache.entries.values()) <= 1024 * 1024
        assert cache.n_tokens == sum(len(e.tokens) for e in cache.entries.values())
        assert len(cache.index) == len(cache.entries)
        prompt = [2, *rng.integers(0, 3, 150).tolist()]
        e, n = cache.best(prompt)
        assert n == max((common_prefix(x.tokens, prompt) for x in cache.entries.values()), default=0)
        assert (e is None) == (n == 0) and (e is None or common_prefix(e.tokens, prompt) == n)
    assert cache.n_evicted > 0
    order = list(cache.entries)
    cache.touch(cache.entries[order[0]])
    assert list(cache.entries)[-1] == order[0]  # used last: evicted last
    cache.clear()
    assert cache.best([2, 0]) == (None, 0) and cache.nbytes == 0 and len(cache.index) == 0


def test_the_slots_tree_follows_every_change_to_a_slots_tokens(tiny_llama_model: Model) -> None:
    """The prefix index's tree of slots after appends, cuts, in-place rewrites, restores and
    taint changes made straight on the slots' lists (as prefill, decode, a context shift and
    the side runners make them): each slot's path is its exact prefix, and `matches` answers as
    a scan of the slots."""
    sch = Scheduler(Context(tiny_llama_model, ContextParams(n_ctx=256, n_seq_max=3, kv_unified=True)), 3)
    idx, rng = sch.prefixes, np.random.default_rng(3)
    base = [2, *rng.integers(0, 3, 60).tolist()]
    for _ in range(800):
        s = sch.slots[int(rng.integers(3))]
        c, op = s.cache, rng.random()
        if op < 0.3:
            c.extend(rng.integers(0, 3, int(rng.integers(1, 6))).tolist())
        elif op < 0.45:
            s.cut(int(rng.integers(0, len(c) + 1)))
        elif op < 0.55:  # --cache-reuse moves a chunk into place
            i = int(rng.integers(0, len(c) + 1))
            c[i : i + 3] = rng.integers(0, 3, 3).tolist()
        elif op < 0.65:  # a context shift drops a middle run; the rest is inexact from there
            n_keep = int(rng.integers(0, len(c) + 1))
            del c[n_keep : n_keep + int(rng.integers(0, 8))]
            s.taint = n_keep if s.taint < 0 else min(s.taint, n_keep)
        elif op < 0.75:  # a restore from host memory or a slot file
            c[:] = base[: int(rng.integers(0, len(base) + 1))]
            s.taint = -1
        elif op < 0.8:
            c.clear()
        elif op < 0.9:
            c.append(int(rng.integers(0, 3)))
        prompt = base[: int(rng.integers(0, len(base)))] + rng.integers(0, 3, 4).tolist()
        m = idx.matches(prompt)  # syncs first
        for sl in sch.slots:
            assert idx.cells.tokens(sl.id) == list(sl.cache[: sl.n_exact])
            n = common_prefix(sl.cache[: sl.n_exact], prompt)
            assert m.get(sl.id, 0) == n
