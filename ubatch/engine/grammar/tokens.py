"""The vocabulary seen by a grammar: every token's code points in one sorted list, walked as a
trie so that a rejected prefix rejects every token below it at once.

A token's text here is llama.cpp's: `token_to_piece` with special tokens shown, decoded from
UTF-8 as its decoder does (an incomplete character at the end is kept as a partial sequence).
The sorted list is the trie: the tokens sharing a prefix are one contiguous range, so a node is
(depth, lo, hi) and its children are found by bisecting. `top_allowed` is a best-first search
over that trie ordered by the best logit below each node: it finds the k highest-logit tokens
the grammar allows while looking only at the nodes that can still beat them. Built once per
vocabulary and cached.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from ubatch.engine.grammar.match import DEAD, Matcher
from ubatch.engine.grammar.utf8 import decode_utf8
from ubatch.engine.vocab.vocab import Vocab

NEG_INF = float("-inf")


@dataclass(slots=True)
class TokenTable:
    """Per vocabulary: the sorted token texts and what each token decodes to."""

    keys: list[str]  # code points of each trie token, sorted
    ids: np.ndarray  # token id at each sorted position
    lens: list[int]
    partial: list[tuple[int, int]]  # (value, n_remain) of an incomplete character at the end
    pos_of: dict[int, int]  # token id -> sorted position
    pieces: list[bytes]  # token id -> bytes (special tokens shown)
    eog: list[int]
    odd: list[int]  # tokens outside the trie that may still match (code points beyond U+10FFFF)
    continuations: list[int]  # tokens starting with a UTF-8 continuation byte
    children: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def decoded(self, tok: int, value: int = 0, n_remain: int = 0) -> tuple[list[int] | str, int, int] | None:
        """A token's code points and end partial after (value, n_remain); None: always rejected."""
        piece = self.pieces[tok]
        if not piece or piece[0] == 0:
            return None
        if n_remain == 0 and tok in self.pos_of:
            p = self.pos_of[tok]
            return self.keys[p], *self.partial[p]
        return decode_utf8(piece, value, n_remain)

    def kids(self, depth: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The children of node (depth, lo, hi): their start positions and code points."""
        hit = self.children.get((depth, lo))
        if hit is not None:
            return hit
        keys, starts, chars = self.keys, [], []
        i = lo
        while i < hi and self.lens[i] == depth:  # tokens equal to the prefix come first
            i += 1
        prefix = keys[lo][:depth]
        while i < hi:
            c = ord(keys[i][depth])
            starts.append(i)
            chars.append(c)
            i = hi if c >= 0x10FFFF else bisect.bisect_left(keys, prefix + chr(c + 1), i, hi)
        hit = (np.asarray(starts, dtype=np.int64), np.asarray(chars, dtype=np.int64))
        self.children[(depth, lo)] = hit
        return hit


_tables: weakref.WeakKeyDictionary[Vocab, TokenTable] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def token_table(vocab: Vocab) -> TokenTable:
    """The vocabulary's table, built on first use (about a second for 262k tokens; the server
    builds it off the engine thread before the first grammar request runs)."""
    t = _tables.get(vocab)
    if t is None:
        with _lock:
            t = _tables.get(vocab)
            if t is None:
                t = _tables[vocab] = _build(vocab)
    return t


def _build(vocab: Vocab) -> TokenTable:
    pieces = [vocab.token_to_piece(i, special=True) for i in range(vocab.n_tokens)]
    eog = sorted(vocab.eog)
    entries, odd, cont = [], [], []
    for tok, piece in enumerate(pieces):
        if tok in vocab.eog or not piece or piece[0] == 0:
            continue
        if 0x80 <= piece[0] < 0xC0:
            cont.append(tok)
            continue
        try:
            key, value, n_remain = piece.split(b"\0")[0].decode("utf-8"), 0, 0
        except UnicodeDecodeError:
            cps, value, n_remain = decode_utf8(piece)
            if n_remain < 0:
                continue
            if any(c > 0x10FFFF for c in cps):
                odd.append(tok)
                continue
            key = "".join(map(chr, cps))
        entries.append((key, tok, value, n_remain))
    order = sorted(range(len(entries)), key=[e[0] for e in entries].__getitem__)
    entries = [entries[i] for i in order]
    keys = [e[0] for e in entries]
    ids = np.asarray([e[1] for e in entries], dtype=np.int64)
    table = TokenTable(
        keys,
        ids,
        list(map(len, keys)),
        [(e[2], e[3]) for e in entries],
        dict(zip(ids.tolist(), range(len(keys)))),
        pieces,
        eog,
        odd,
        cont,
    )
    table.kids(0, 0, len(keys))  # the root's children: every search starts there
    return table


_NODE, _LEAF, _KIDS, _RANGE = range(4)  # what a heap entry stands for
# What the search keeps: a trie node (depth, lo, hi, matcher state), whose tokens [lo, hi) share
# their first `depth` code points; a node's live children, best first (starts, ends, states, best
# logits, the node's depth); a range in logit order for a negated token reference (lo, ranked
# positions from lo, the token it skips).
TrieNode = tuple[int, int, int, int]
Kids = tuple[list[int], list[int], list[int], list[float], int]
Ranked = tuple[int, np.ndarray, int]


def top_allowed(
    table: TokenTable, m: Matcher, sid: int, xs: np.ndarray, x: np.ndarray, k: int, skip: set[int]
) -> list[int]:
    """The k tokens of highest logit that the grammar allows from state `sid` (with no partial
    character pending), best first; fewer if fewer are allowed. `xs` is the logits in sorted
    order (x[table.ids]), `x` by token id; tokens in `skip` and those at -inf are left out."""
    # heap entries: (-best logit below, push order, kind, a, b); `a` is a leaf's token id or the
    # index of a node, child list or ranked range in its list; `b` the child or rank to take next
    heap: list[tuple[float, int, int, int, int]] = []
    order = itertools.count()
    nodes: list[TrieNode] = []
    kids: list[Kids] = []
    ranges: list[Ranked] = []
    out: list[int] = []
    got: set[int] = set()  # a token can be reached twice (by its text and by a token reference)

    def push(best: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(heap, (-best, next(order), kind, a, b))

    def leaf(tok: int) -> None:
        v = float(x[tok])
        if v > NEG_INF and tok not in skip:
            push(v, _LEAF, tok)

    def node(best: float, n: TrieNode) -> None:
        push(best, _NODE, len(nodes))
        nodes.append(n)

    def expand(n: TrieNode) -> None:
        depth, lo, hi, state = n
        info = m.info(state)
        i = lo
        while i < hi and table.lens[i] == depth:  # tokens that end here: check their partial tail
            value, n_remain = table.partial[i]
            if n_remain == 0 or m.partial_ok(state, value, n_remain):
                leaf(int(table.ids[i]))
            i += 1
        for negated, tok in info.token_tops:  # llama.cpp: a token reference matches by id
            if not negated:
                p = table.pos_of.get(tok, -1)
                if i <= p < hi:
                    leaf(tok)
            elif i < hi:
                ranked = np.argsort(-xs[i:hi], kind="stable")
                push(float(xs[i + ranked[0]]), _RANGE, len(ranges))
                ranges.append((i, ranked, tok))
        starts, chars = table.kids(depth, lo, hi)
        if not len(starts):
            return
        nexts = info.nexts_np[np.searchsorted(info.bounds_np, chars, side="right") - 1]
        maxes = np.maximum.reduceat(xs[lo:hi], starts - lo)
        ends = np.append(starts[1:], hi)
        keep = (nexts != DEAD) & (maxes > NEG_INF)
        if not keep.any():
            return
        rank = np.argsort(-maxes[keep], kind="stable")
        sel = (starts[keep][rank], ends[keep][rank], nexts[keep][rank], maxes[keep][rank])
        starts_l, ends_l, nexts_l, maxes_l = (a.tolist() for a in sel)
        push(maxes_l[0], _KIDS, len(kids))
        kids.append((starts_l, ends_l, nexts_l, maxes_l, depth))

    if m.info(sid).accepting:
        for tok in table.eog:
            leaf(tok)
    if len(xs):
        node(float(xs.max()), (0, 0, len(xs), sid))
    while heap and len(out) < k:
        neg, _, kind, a, b = heapq.heappop(heap)
        if neg == -NEG_INF:
            break
        if kind == _LEAF:
            if a not in got:
                got.add(a)
                out.append(a)
        elif kind == _NODE:
            expand(nodes[a])
        elif kind == _KIDS:
            starts, ends, nexts, maxes, depth = kids[a]
            node(maxes[b], (depth + 1, starts[b], ends[b], nexts[b]))
            if b + 1 < len(starts):
                push(maxes[b + 1], _KIDS, a, b + 1)
        else:  # every token of a range, in logit order (a negated token reference)
            lo, ranked, negated = ranges[a]
            if (tok := int(table.ids[lo + ranked[b]])) != negated:
                leaf(tok)
            if b + 1 < len(ranked):
                push(float(xs[lo + ranked[b + 1]]), _RANGE, a, b + 1)
    return out
