"""A forward pass as a graph: recorded once per ubatch shape, laid out in one workspace, run.

The model code (engine/graph/forward.py) calls the op methods of a `GraphBuilder`
(engine/graph/builder.py), which computes nothing: it records nodes (the op's arguments with
symbols for tensors, output shape and dtype, scratch). Weights and the KV cache are leaves the
graph reads but does not own, as ggml-alloc skips tensors that are allocated elsewhere.
`lay_out_graph` gives every input, intermediate and scratch tensor an offset in one buffer by
liveness; `bind` resolves each node's arguments to views once and asks the backend for one call
per node (`Ops.bind`); `run_graph` runs those calls.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from ubatch.engine.graph.workspace import Layout, Request, lay_out
from ubatch.kernels.ops import INPLACE_OPS, MaskCells, NodeArgs, Ops, ScratchSpec, Step

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

D = TypeVar("D", bound="DataclassInstance")


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
    op: str  # "input", "view" or the Ops method the node calls
    args: NodeArgs[Sym] | None  # the op's arguments, graph tensors as symbols; None: input or view
    inputs: tuple[Sym, ...]  # the graph tensors it reads (a view: its source), for liveness
    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str
    scratch: ScratchSpec = field(default_factory=list)
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
    talks: bool = False  # it has collectives (tensor parallelism): run launch by launch, never captured
    _bound: tuple[tuple[int, int], Bound] | None = None  # ((workspace ptr, ops id), what bind made)
    _out_call: tuple[int, NodeArgs[Tensor], list[Tensor]] | None = None  # (step index, args, scratch) of the output
    _raw: list[Step] = field(default_factory=list)  # the bound calls before fusing
    _head: list[Step] = field(default_factory=list)  # the fused calls before the output node's

    @property
    def size(self) -> int:
        return self.layout.size if self.layout else 0

    def describe_nodes(self, prefix: str, suffix: str) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, shape, bytes) of the nodes named prefix...suffix and of their scratch, in graph order."""
        out = []
        for n in self.nodes:
            if n.op != "view" and n.name.startswith(prefix) and n.name.endswith(suffix):
                out.append((n.name, n.shape, n.nbytes))
                out += [(f"{n.name}.scratch{j}", shape, nbytes(shape, dt)) for j, (shape, dt) in enumerate(n.scratch)]
        return out

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


@functools.cache
def _field_names(cls: type[DataclassInstance]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _fields(obj: DataclassInstance) -> list[tuple[str, object]]:
    return [(name, getattr(obj, name)) for name in _field_names(type(obj))]


def node_inputs(a: NodeArgs[Sym]) -> tuple[Sym, ...]:
    """The graph tensors among a node's arguments, in field order (the first is the one an
    in-place op may take over)."""
    out: list[Sym] = []
    for _, v in _fields(a):
        if isinstance(v, MaskCells):
            out += [c for _, c in _fields(v) if isinstance(c, Sym)]
        elif isinstance(v, Sym):
            out.append(v)
    return tuple(out)


def _with_tensors(obj: D, vals: dict[int, Tensor]) -> D:
    """A copy of obj with every symbol among its fields (and its mask cells') replaced by its tensor."""
    values = [
        vals[v.id] if isinstance(v, Sym) else _with_tensors(v, vals) if isinstance(v, MaskCells) else v
        for _, v in _fields(obj)
    ]
    make: Callable[..., D] = type(obj)  # the dataclass's own __init__, every field in order
    return make(*values)


def _resolve(a: NodeArgs[Sym], vals: dict[int, Tensor]) -> NodeArgs[Tensor]:
    """The node's arguments on the workspace's views: the same dataclass, its symbols replaced."""
    return cast("NodeArgs[Tensor]", _with_tensors(a, vals))


def lay_out_graph(g: Graph) -> tuple[Layout, dict[tuple[int, int], int]]:
    """Liveness over the nodes (views extend their base's life) -> one workspace layout."""
    last: dict[int, int] = {}
    for n in g.nodes:
        for a in n.inputs:
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
        if n.op in INPLACE_OPS:  # declared in kernels/ops.py: the output may take over its first input
            a = n.inputs[0]
            if g.nodes[a.id].base < 0 and g.nodes[a.id].nbytes == n.nbytes:
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


@dataclass(slots=True)
class Bound:
    """A graph bound to one workspace and one backend: its input views, the calls to run in
    order, and the output tensor."""

    inputs: dict[str, Tensor]
    host: dict[str, npt.NDArray[np.generic]] | None  # numpy views of the input views (host memory)
    steps: list[Step]
    output: Tensor


def bind(g: Graph, ops: Ops, workspace: Tensor) -> Bound:
    """Every node's inputs, output and scratch resolved to views of the workspace once per
    (buffer, backend), each node made one call by the backend (`Ops.bind`), so a step runs no
    lookups per node, and runs of calls fused where the backend can (`Ops.fuse`). On host
    memory the input views also get numpy views (`input_views`)."""
    assert g.layout is not None and g.layout.size <= workspace.numel()
    key = (workspace.data_ptr(), id(ops))
    if g._bound is not None and g._bound[0] == key:
        return g._bound[1]

    def place(off: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return workspace[off : off + nbytes(shape, dtype)].view(dtype).view(shape)

    vals: dict[int, Tensor] = {}
    steps: list[Step] = []
    g._out_call = None
    for n in g.nodes:
        if n.op == "view":
            vals[n.id] = vals[n.inputs[0].id].view(n.shape)
            continue
        if n.nbytes:
            out = place(g.layout.offsets[n.id], n.shape, n.dtype)
        else:  # zero-size (a ubatch without outputs) or a store node: no memory
            out = torch.empty(n.shape, dtype=n.dtype, device=workspace.device)
        vals[n.id] = out
        if n.args is None:
            continue  # an input: filled from the step's inputs
        scratch = [place(g.layout.offsets[g.scratch_keys[(n.id, j)]], s, d) for j, (s, d) in enumerate(n.scratch)]
        a = _resolve(n.args, vals)
        if n.id == g.output and n.nbytes:
            g._out_call = (len(steps), a, scratch)
        steps.append(ops.bind(a, out, scratch))
    inputs = {n.name: vals[n.id] for n in g.nodes if n.op == "input"}
    host = {k: v.numpy() for k, v in inputs.items()} if workspace.device.type == "cpu" else None
    # the output node's call starts a run of its own, so pointing it elsewhere re-fuses only that
    cut = g._out_call[0] if g._out_call else len(steps)
    g._raw, g._head = steps, ops.fuse(steps[:cut])
    bound = Bound(inputs, host, g._head + ops.fuse(steps[cut:]), vals[g.output])
    g._bound = (key, bound)
    return bound


def input_views(
    g: Graph, ops: Ops, workspace: Tensor
) -> tuple[dict[str, Tensor], dict[str, npt.NDArray[np.generic]] | None]:
    """The bound input views, and numpy views of them when the workspace is host memory (a
    step's inputs are then written in place, with no tensor made per input per step)."""
    b = bind(g, ops, workspace)
    return b.inputs, b.host


def bind_output(g: Graph, ops: Ops, workspace: Tensor, dest: Tensor) -> bool:
    """Point the output node at `dest` (rows of the caller's output buffer) instead of its
    workspace view, so no copy follows the step; it stays there until pointed elsewhere or the
    graph is bound again. False, with nothing changed, where the output cannot move."""
    bound = bind(g, ops, workspace)
    cur, call = bound.output, g._out_call
    if call is None or dest.shape != cur.shape or dest.dtype != cur.dtype or dest.device != cur.device:
        return False
    if dest.data_ptr() == cur.data_ptr():
        return True
    if not dest.is_contiguous():
        return False
    i, a, scratch = call
    g._raw[i] = ops.bind(a, dest, scratch)
    bound.steps[:] = g._head + ops.fuse(g._raw[i:])
    bound.output = dest
    return True


def bind_inputs(g: Graph, ops: Ops, workspace: Tensor, inputs: dict[str, Tensor]) -> Bound:
    """The bound graph, with the step's inputs (those not already written in place) copied
    into their workspace views."""
    b = bind(g, ops, workspace)
    for name, t in inputs.items():
        b.inputs[name].copy_(t)
    return b


def run_graph(g: Graph, ops: Ops, workspace: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    """One forward pass: the inputs copied in, the bound calls run in order."""
    b = bind_inputs(g, ops, workspace, inputs)
    for step in b.steps:
        step()
    return b.output
