"""A radix tree of token sequences (SGLang's RadixCache, without its KV pages): the index the
prefix cache searches by longest common prefix.

Each edge is a run of tokens; a node is where runs diverge or where a sequence ends. Every
sequence has a holder key (a slot's sequence id, a host-memory entry) and each node knows the
holders whose tokens run through it, so a lookup walks the prompt once, comparing edge runs in
C-sized chunks: O(prompt length) whatever the number of holders, where a scan of the holders is
O(holders x length). A holder's tokens change only at its end (tokens appended, the tail cut),
which touches the nodes of that end alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

H = TypeVar("H", bound=Hashable)

_CHUNK0, _CHUNK_MAX = 16, 1024  # tokens compared per slice while runs agree (doubling)


def run_prefix(a: list[int], b: list[int], bi: int) -> int:
    """How many leading tokens of `a` equal b[bi:]: slices compared in growing chunks (at C
    speed), then token by token inside the first chunk that differs."""
    n = min(len(a), len(b) - bi)
    i, step = 0, _CHUNK0
    while i < n:
        j = min(n, i + step)
        if a[i:j] != b[bi + i : bi + j]:
            while a[i] == b[bi + i]:
                i += 1
            return i
        i, step = j, min(step * 2, _CHUNK_MAX)
    return n


class RadixNode(Generic[H]):
    """`edge`: the tokens from the parent to here; `depth`: tokens from the root to the end of
    `edge`; `holders`: every holder whose tokens pass through or end here (insertion order);
    `ends`: the holders whose tokens end exactly here."""

    __slots__ = ("children", "depth", "edge", "ends", "holders", "parent")

    def __init__(self, edge: list[int], depth: int, parent: RadixNode[H] | None) -> None:
        self.edge, self.depth, self.parent = edge, depth, parent
        self.children: dict[int, RadixNode[H]] = {}  # by the first token of the child's edge
        self.holders: dict[H, None] = {}
        self.ends: dict[H, None] = {}


class RadixTree(Generic[H]):
    """Token sequences by holder, searchable by longest common prefix. A holder with no tokens
    is not in the tree. Nodes that no holder ends at and that have one child are merged into it,
    so the tree has at most two nodes per holder."""

    def __init__(self) -> None:
        self.root: RadixNode[H] = RadixNode([], 0, None)
        self._end: dict[H, RadixNode[H]] = {}  # where each holder's tokens end

    def __len__(self) -> int:
        return len(self._end)

    def __contains__(self, key: H) -> bool:
        return key in self._end

    def length(self, key: H) -> int:
        """The holder's number of tokens (0 when absent)."""
        node = self._end.get(key)
        return node.depth if node is not None else 0

    def tokens(self, key: H) -> list[int]:
        """The holder's tokens, read back from its path."""
        runs: list[list[int]] = []
        node = self._end.get(key)
        while node is not None:
            runs.append(node.edge)
            node = node.parent
        return [t for run in reversed(runs) for t in run]

    # -- changes ----------------------------------------------------------------------------------
    def insert(self, key: H, tokens: list[int]) -> None:
        """Set the holder's tokens (replacing any it had)."""
        self.remove(key)
        if tokens:
            self._grow(self.root, tokens, 0, key)

    def remove(self, key: H) -> None:
        self.truncate(key, 0)

    def extend(self, key: H, tokens: list[int]) -> None:
        """Append tokens to the holder's sequence."""
        if not tokens:
            return
        node = self._end.get(key)
        if node is None:
            self._grow(self.root, tokens, 0, key)
        elif not node.children and len(node.holders) == 1:  # a leaf of its own: the run grows
            node.edge.extend(tokens)
            node.depth += len(tokens)
        else:
            del node.ends[key]
            self._grow(node, tokens, 0, key)
            self._merge(node)

    def truncate(self, key: H, n: int) -> None:
        """Keep the holder's first n tokens (n = 0 removes it)."""
        node = self._end.get(key)
        if node is None or n >= node.depth:
            return
        del node.ends[key]
        while node.parent is not None and node.depth - len(node.edge) >= n:  # starts at or past n
            parent = node.parent
            self._leave(node, key)
            node = parent
        if node.parent is None:
            del self._end[key]
            return
        if n < node.depth:  # n falls inside this node's run: it ends at a new node there
            top = self._split(node, n - (node.depth - len(node.edge)))
            self._leave(node, key)
            node = top
        node.ends[key] = None
        self._end[key] = node

    def clear(self) -> None:
        self.root = RadixNode([], 0, None)
        self._end.clear()

    # -- lookups ----------------------------------------------------------------------------------
    def walk(self, tokens: list[int]) -> Iterator[tuple[RadixNode[H], int, bool]]:
        """The nodes along `tokens`' path: (node, tokens matched up to it, whether its whole run
        matched). The last one may have matched only part of its run."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                return
            k = run_prefix(child.edge, tokens, i)
            i += k
            whole = k == len(child.edge)
            yield child, i, whole
            if not whole:
                return
            node = child

    def longest(self, tokens: list[int]) -> tuple[H | None, int]:
        """A holder sharing the longest prefix with `tokens` (the first to reach that node),
        and that prefix's length; (None, 0) when no holder starts like `tokens`."""
        reached = deque(self.walk(tokens), maxlen=1)  # the last node reached is the answer
        if not reached:
            return None, 0
        node, n, _ = reached[0]
        return next(iter(node.holders)), n

    def match_each(self, tokens: list[int]) -> dict[H, int]:
        """Every holder sharing a prefix with `tokens`, with its length. Costs the holders along
        the path on top of the walk: for trees of few holders (the slots)."""
        out: dict[H, int] = {}
        for node, n, _ in self.walk(tokens):
            for h in node.holders:
                out[h] = n
        return out

    def within(self, tokens: list[int]) -> list[H]:
        """The holders whose whole sequence is a prefix of `tokens` (shortest first)."""
        out: list[H] = []
        for node, _, whole in self.walk(tokens):
            if whole:
                out.extend(node.ends)
        return out

    # -- structure --------------------------------------------------------------------------------
    def _grow(self, node: RadixNode[H], tokens: list[int], i: int, key: H) -> None:
        """Add tokens[i:] below `node` (where the holder's tokens so far end) for `key`."""
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf: RadixNode[H] = RadixNode(tokens[i:], node.depth + len(tokens) - i, node)
                leaf.holders[key] = None
                node.children[tokens[i]] = leaf
                node = leaf
                break
            k = run_prefix(child.edge, tokens, i)
            if k < len(child.edge):
                child = self._split(child, k)
            child.holders[key] = None
            node, i = child, i + k
        node.ends[key] = None
        self._end[key] = node

    def _split(self, node: RadixNode[H], k: int) -> RadixNode[H]:
        """Cut node's run after k tokens (0 < k < len): the new upper node is returned."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.edge)
        top: RadixNode[H] = RadixNode(node.edge[:k], node.depth - len(node.edge) + k, parent)
        top.holders = dict(node.holders)
        parent.children[node.edge[0]] = top
        node.edge = node.edge[k:]
        node.parent = top
        top.children[node.edge[0]] = node
        return top

    def _leave(self, node: RadixNode[H], key: H) -> None:
        """`key` no longer passes through `node`: a node nobody holds goes; one left with a
        single child and no ending holder is merged into that child."""
        del node.holders[key]
        parent = node.parent
        assert parent is not None
        if not node.holders:
            del parent.children[node.edge[0]]
            node.parent = None
        else:
            self._merge(node)

    def _merge(self, node: RadixNode[H]) -> None:
        parent = node.parent
        if parent is None or node.ends or len(node.children) != 1:
            return
        (child,) = node.children.values()
        child.edge = node.edge + child.edge
        child.parent = parent
        parent.children[child.edge[0]] = child
        node.parent = None
