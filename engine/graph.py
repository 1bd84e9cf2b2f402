"""A forward pass as a graph: recorded once per ubatch shape, laid out in one workspace, run.

The model code (engine/forward.py) calls the op methods of a `GraphBuilder`, which computes
nothing: it records nodes (op, inputs, output shape and dtype, scratch). Weights and the KV
cache are leaves the graph reads but does not own, as ggml-alloc skips tensors that are
allocated elsewhere. `lay_out_graph` gives every input, intermediate and scratch tensor an offset
in one buffer by liveness; `run_graph` executes the nodes with each op writing into its view.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.ops import KVTensor, Ops, attn_scratch
from ..kernels.weight import QWeight
from .workspace import Layout, Request, lay_out

# ops whose output may take over the memory of their first input when that input dies there
INPLACE_OPS = {"scale", "add", "glu", "softcap"}


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(slots=True)
class Sym:
    """A tensor of a graph under construction: node id, shape, dtype."""

    id: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


@dataclass(slots=True)
class Node:
    id: int
    op: str  # "input", "view" or an Ops method name
    args: tuple[Any, ...]  # Sym ids are ints wrapped in Sym; weights/stores stay objects
    kwargs: dict[str, Any]
    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str
    scratch: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    base: int = -1  # for views: the node whose memory this aliases

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


@dataclass
class Graph:
    nodes: list[Node]
    inputs: dict[str, int]
    output: int
    layout: Layout | None = None
    scratch_keys: dict[tuple[int, int], int] = field(default_factory=dict)
    _bound: tuple[tuple[int, int], list] | None = None  # ((workspace ptr, ops id), bound steps)

    @property
    def size(self) -> int:
        return self.layout.size if self.layout else 0

    def describe_peak(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, shape, bytes) of the tensors alive when the workspace peaked, largest first."""
        assert self.layout is not None
        rev = {v: k for k, v in self.scratch_keys.items()}
        out = []
        for key in self.layout.live_at_peak:
            if key in rev:
                nid, j = rev[key]
                shape, dtype = self.nodes[nid].scratch[j]
                out.append((f"{self.nodes[nid].name}.scratch{j}", shape, nbytes(shape, dtype)))
            else:
                n = self.nodes[key]
                out.append((n.name, n.shape, n.nbytes))
        return sorted(out, key=lambda x: -x[2])


class GraphBuilder:
    """Records the forward pass; each method mirrors an `Ops` method but returns a Sym. The
    backend is asked for the scratch its ops need (e.g. dequantisation tiles), so that scratch
    is laid out in the workspace and counted in the compute buffer like any intermediate."""

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self.nodes: list[Node] = []
        self.inputs: dict[str, int] = {}

    def _add(
        self,
        op: str,
        args: tuple,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        name: str,
        scratch: list | None = None,
        base: int = -1,
        **kwargs: Any,
    ) -> Sym:
        n = Node(len(self.nodes), op, args, kwargs, tuple(shape), dtype, name, scratch or [], base)
        self.nodes.append(n)
        return Sym(n.id, n.shape, dtype)

    def input(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Sym:
        s = self._add("input", (), shape, dtype, name)
        self.inputs[name] = s.id
        return s

    def view(self, x: Sym, shape: tuple[int, ...], name: str = "") -> Sym:
        assert math.prod(shape) == math.prod(x.shape), (x.shape, shape)
        base = self.nodes[x.id].base if self.nodes[x.id].base >= 0 else x.id
        return self._add("view", (x,), shape, x.dtype, name or self.nodes[x.id].name, base=base)

    def get_rows(self, w: QWeight, ids: Sym, name: str) -> Sym:
        return self._add("get_rows", (w, ids), (ids.shape[0], w.shape[1]), torch.float32, name)

    def linear(self, x: Sym, w: QWeight, name: str) -> Sym:
        return self._add(
            "linear",
            (x, w),
            (x.shape[0], w.shape[0]),
            torch.float32,
            name,
            scratch=self.ops.linear_scratch(x.shape[0], w),
        )

    def rms_norm(self, x: Sym, w: torch.Tensor, eps: float, name: str) -> Sym:
        return self._add(
            "rms_norm", (x, w, eps), x.shape, torch.float32, name, scratch=[((*x.shape[:-1], 1), torch.float32)]
        )

    def rope(self, x: Sym, cos: Sym, sin: Sym, neox: bool, name: str) -> Sym:
        return self._add("rope", (x, cos, sin, neox), x.shape, torch.float32, name)

    def scale(self, x: Sym, s: float, name: str) -> Sym:
        return self._add("scale", (x, s), x.shape, torch.float32, name)

    def add(self, a: Sym, b: Sym, name: str) -> Sym:
        return self._add("add", (a, b), a.shape, torch.float32, name)

    def glu(self, gate: Sym, up: Sym, act: str, name: str) -> Sym:
        return self._add("glu", (gate, up, act), gate.shape, torch.float32, name)

    def rows(self, x: Sym, idx: Sym, name: str) -> Sym:
        return self._add("rows", (x, idx), (idx.shape[0], *x.shape[1:]), torch.float32, name)

    def softcap(self, x: Sym, c: float, name: str) -> Sym:
        return self._add("softcap", (x, c), x.shape, torch.float32, name)

    def kv_store(self, store: KVTensor, slots: Sym, x: Sym, name: str) -> Sym:
        """Write rows into the cache; a half-precision cache gets a scratch for the cast."""
        dt = store.data.dtype
        scratch = [(x.shape, dt)] if dt not in (torch.float32, torch.uint8) else []
        return self._add("kv_store", (store, slots, x), (0,), torch.float32, name, scratch=scratch)

    def attention(
        self,
        q: Sym,
        k: KVTensor,
        v: KVTensor,
        starts: Sym,
        n_kv: int,
        mask: Sym | tuple,
        visible: Sym,
        scale: float,
        after: tuple[Sym, Sym],
        name: str,
    ) -> Sym:
        """Attention of q over the layer's KV stores; `after` orders it behind this layer's stores.
        `mask` is the mask tensor, or the cells the backend computes it from (cell pos, cell
        sequence bits, query pos, query sequence bit, n_swa, query causal limit): those follow
        `after` in the node's arguments and the mask slot holds None."""
        g, t, h, d = q.shape
        cells = mask if isinstance(mask, tuple) else ()
        plan = getattr(self.ops, "attention_scratch", None)  # a backend whose kernel needs other scratch
        scratch = (
            plan(g, t, h, k.n_head, n_kv, d, v.head_dim, k.ggml_type, v.ggml_type)
            if plan
            else attn_scratch(g, t, h, k.n_head, n_kv, d, v.head_dim)
        )
        return self._add(
            "attention",
            (q, k, v, starts, n_kv, None if cells else mask, scale, visible, *after, *cells),
            (g * t, h * v.head_dim),
            torch.float32,
            name,
            scratch=scratch,
        )

    def finish(self, output: Sym) -> Graph:
        g = Graph(self.nodes, dict(self.inputs), output.id)
        g.layout, g.scratch_keys = lay_out_graph(g)
        return g


def _sym_args(n: Node) -> list[Sym]:
    return [a for a in n.args if isinstance(a, Sym)]


def lay_out_graph(g: Graph) -> tuple[Layout, dict[tuple[int, int], int]]:
    """Liveness over the nodes (views extend their base's life) -> one workspace layout."""
    last: dict[int, int] = {}
    for n in g.nodes:
        for a in _sym_args(n):
            b = g.nodes[a.id].base if g.nodes[a.id].base >= 0 else a.id
            last[b] = n.id
    last[g.nodes[g.output].base if g.nodes[g.output].base >= 0 else g.output] = len(g.nodes)
    reqs: list[Request] = []
    scratch_keys: dict[tuple[int, int], int] = {}
    next_key = len(g.nodes)
    for n in g.nodes:
        if n.op == "view":
            continue
        inplace = None
        if n.op in INPLACE_OPS:
            a = n.args[0]
            if isinstance(a, Sym) and g.nodes[a.id].base < 0 and g.nodes[a.id].nbytes == n.nbytes:
                inplace = a.id
        if n.nbytes:
            reqs.append(Request(n.id, n.nbytes, n.id, last.get(n.id, n.id), inplace))
        for j, (shape, dtype) in enumerate(n.scratch):
            size = nbytes(shape, dtype)
            scratch_keys[(n.id, j)] = next_key
            reqs.append(Request(next_key, size, n.id, n.id))
            next_key += 1
    reqs.sort(key=lambda r: (r.first, r.key))
    return lay_out(reqs), scratch_keys


def bind(g: Graph, ops: Ops, workspace: torch.Tensor) -> list[Callable[[], Any]]:
    """The graph as a list of ready calls: every node's inputs, output and scratch resolved to
    views of the workspace once per (buffer, backend), so a step runs no lookups per node."""
    assert g.layout is not None and g.layout.size <= workspace.numel()
    key = (workspace.data_ptr(), id(ops))
    if g._bound is not None and g._bound[0] == key:
        return g._bound[1]

    def place(off: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return workspace[off : off + nbytes(shape, dtype)].view(dtype).view(shape)

    vals: dict[int, torch.Tensor] = {}
    steps: list[Callable[[], Any]] = []
    bind_op = getattr(ops, "bind", None)
    for n in g.nodes:
        if n.op == "view":
            vals[n.id] = vals[n.args[0].id].view(n.shape)
            continue
        if n.nbytes:
            out = place(g.layout.offsets[n.id], n.shape, n.dtype)
        else:  # zero-size (a ubatch without outputs) or a store node: no memory
            out = torch.empty(n.shape, dtype=n.dtype, device=workspace.device)
        scratch = [place(g.layout.offsets[g.scratch_keys[(n.id, j)]], s, d) for j, (s, d) in enumerate(n.scratch)]
        vals[n.id] = out
        a = [vals[x.id] if isinstance(x, Sym) else x for x in n.args]
        if n.op == "input":
            continue  # filled by run_graph from the step's inputs
        fast = bind_op(n.op, a, None if n.op == "kv_store" else out, scratch) if bind_op else None
        if fast is not None:  # the backend compiled this node into one call
            steps.append(fast)
        elif n.op == "kv_store":
            steps.append(functools.partial(ops.kv_store, a[0], a[1], a[2], scratch))
        elif n.op == "attention":
            q, k, v, starts, n_kv, mask, scale, visible = a[:8]
            kw = {"cells": tuple(a[10:])} if len(a) > 10 else {}
            steps.append(
                functools.partial(
                    ops.attention, q, k, v, starts, n_kv, mask, scale, out=out, scratch=scratch, visible=visible, **kw
                )
            )
        elif n.scratch:
            steps.append(functools.partial(getattr(ops, n.op), *a, out=out, scratch=scratch))
        else:
            steps.append(functools.partial(getattr(ops, n.op), *a, out=out))
    inputs = {n.name: vals[n.id] for n in g.nodes if n.op == "input"}
    bound = [inputs, steps, vals[g.output]]
    g._bound = (key, bound)
    return bound


def run_graph(g: Graph, ops: Ops, workspace: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Copy the step's inputs into their workspace views and run the bound calls in order."""
    views, steps, output = bind(g, ops, workspace)
    for name, t in inputs.items():
        views[name].copy_(t)
    for step in steps:
        step()
    return output
