"""A forward pass as a graph: recorded once per ubatch shape, laid out in one workspace, run.

The model code (engine/forward.py) calls the op methods of a `GraphBuilder`
(engine/graph_builder.py), which computes nothing: it records nodes (op, inputs, output shape and dtype, scratch). Weights and the KV
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

import numpy as np
import torch

from ubatch.engine.graph.workspace import Layout, Request, lay_out
from ubatch.kernels.ops import Ops

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
    _bound: tuple[tuple[int, int], list] | None = None  # ((workspace ptr, ops id), bind's list)
    _host: dict[str, np.ndarray] | None = None  # numpy views of the input views (host memory)
    _out_call: tuple | None = None  # (step index, op, args, scratch) of the output node
    _raw: list = field(default_factory=list)  # the bound calls before fusing
    _head: list = field(default_factory=list)  # the fused calls before the output node's

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


def _step(ops: Ops, op: str, a: list, out: torch.Tensor, scratch: list[torch.Tensor]) -> Callable[[], Any]:
    """One node as a zero-argument call: the backend's compiled call, or its method bound."""
    bind_op = getattr(ops, "bind", None)
    fast = bind_op(op, a, None if op == "kv_store" else out, scratch) if bind_op else None
    if fast is not None:  # the backend compiled this node into one call
        return fast
    if op == "kv_store":
        return functools.partial(ops.kv_store, a[0], a[1], a[2], scratch)
    if op == "attention":
        q, k, v, starts, n_kv, mask, scale, visible = a[:8]
        kw = {"cells": tuple(a[10:])} if len(a) > 10 else {}
        return functools.partial(
            ops.attention, q, k, v, starts, n_kv, mask, scale, out=out, scratch=scratch, visible=visible, **kw
        )
    if scratch:
        return functools.partial(getattr(ops, op), *a, out=out, scratch=scratch)
    return functools.partial(getattr(ops, op), *a, out=out)


def _fuse(ops: Ops, steps: list[Callable[[], Any]]) -> list[Callable[[], Any]]:
    """Runs of consecutive calls as one call each where the backend can (`fuse`: the CPU
    backend's C calls become one ctypes call per run), else the steps as they are."""
    fuse = getattr(ops, "fuse", None)
    return fuse(steps) if fuse else list(steps)


def bind(g: Graph, ops: Ops, workspace: torch.Tensor) -> list:
    """The graph as [input views, ready calls, output]: every node's inputs, output and scratch
    resolved to views of the workspace once per (buffer, backend), so a step runs no lookups per
    node, and runs of calls fused where the backend can. On host memory the input views also
    get numpy views (`input_views`)."""
    assert g.layout is not None and g.layout.size <= workspace.numel()
    key = (workspace.data_ptr(), id(ops))
    if g._bound is not None and g._bound[0] == key:
        return g._bound[1]

    def place(off: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return workspace[off : off + nbytes(shape, dtype)].view(dtype).view(shape)

    vals: dict[int, torch.Tensor] = {}
    steps: list[Callable[[], Any]] = []
    g._out_call = None
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
            continue  # filled from the step's inputs
        if n.id == g.output and n.nbytes:
            g._out_call = (len(steps), n.op, a, scratch)
        steps.append(_step(ops, n.op, a, out, scratch))
    inputs = {n.name: vals[n.id] for n in g.nodes if n.op == "input"}
    g._host = {k: v.numpy() for k, v in inputs.items()} if workspace.device.type == "cpu" else None
    # the output node's call starts a run of its own, so pointing it elsewhere re-fuses only that
    cut = g._out_call[0] if g._out_call else len(steps)
    g._raw, g._head = steps, _fuse(ops, steps[:cut])
    bound = [inputs, g._head + _fuse(ops, steps[cut:]), vals[g.output]]
    g._bound = (key, bound)
    return bound


def input_views(
    g: Graph, ops: Ops, workspace: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray] | None]:
    """The bound input views, and numpy views of them when the workspace is host memory (a
    step's inputs are then written in place, with no tensor made per input per step)."""
    views = bind(g, ops, workspace)[0]
    return views, g._host


def bind_output(g: Graph, ops: Ops, workspace: torch.Tensor, dest: torch.Tensor) -> bool:
    """Point the output node at `dest` (rows of the caller's output buffer) instead of its
    workspace view, so no copy follows the step; it stays there until pointed elsewhere or the
    graph is bound again. False, with nothing changed, where the output cannot move."""
    bound = bind(g, ops, workspace)
    cur, call = bound[2], g._out_call
    if call is None or dest.shape != cur.shape or dest.dtype != cur.dtype or dest.device != cur.device:
        return False
    if dest.data_ptr() == cur.data_ptr():
        return True
    if not dest.is_contiguous():
        return False
    i, op, a, scratch = call
    g._raw[i] = _step(ops, op, a, dest, scratch)
    bound[1][:] = g._head + _fuse(ops, g._raw[i:])
    bound[2] = dest
    return True


def run_graph(g: Graph, ops: Ops, workspace: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Copy the step's inputs (those not already written in place) into their workspace views
    and run the bound calls in order."""
    views, steps, output = bind(g, ops, workspace)
    for name, t in inputs.items():
        views[name].copy_(t)
    for step in steps:
        step()
    return output
