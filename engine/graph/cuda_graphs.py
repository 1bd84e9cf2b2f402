"""CUDA graphs for decode ubatches: a step's kernels launched once into a graph, then replayed.

A decode step of a small model is dozens of short kernels, and launching them one by one from
Python costs more than running them. The graph of a shape key (n_tokens, n_outputs, the groups
and the padded n_kv of each cache: exactly `GraphShape`, which is why n_kv is padded to 256) is
bound to fixed workspace addresses (engine/graph.py), and the step's inputs are copied into
those same views, so a captured CUDA graph stays valid while the key holds. The first ubatch of
a key runs eagerly (Triton compiles its kernels then), the second is captured, later ones
replay. On the CPU, or with a backend that does not ask for it (`ops.cuda_graphs`), a step is
plain `run_graph`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ubatch.engine.graph.graph import Graph, bind, run_graph
from ubatch.kernels.ops import Ops

GRAPH_MAX_TOKENS = 64  # ubatches up to this many rows are captured (decode, -np up to 64)
MAX_GRAPHS = 16  # captured graphs kept (each holds a little private memory)


@dataclass(slots=True)
class GraphCounters:
    """What the performance summary and `ubatch bench` report."""

    captures: int = 0
    replays: int = 0
    eager: int = 0  # steps run launch by launch (first sight of a key, prefill, CPU)

    def line(self) -> str:
        return f"CUDA graphs: {self.captures} captured, {self.replays} replays, {self.eager} steps launched eagerly"

    def since(self, before: GraphCounters) -> GraphCounters:
        """The counts added after `before` (a copy taken earlier)."""
        return GraphCounters(self.captures - before.captures, self.replays - before.replays, self.eager - before.eager)


def summary(c: GraphCounters | None) -> str:
    """The counters' line, or 'off' where no step went through a runner (on a GPU the first
    step of every shape runs eagerly, so a run there never counts nothing)."""
    if c is None or c == GraphCounters():
        return "CUDA graphs: off (the kernels run in Triton's interpreter)"
    return c.line()


TOTALS = GraphCounters()  # every runner of the process together: `ubatch bench` reads it per test


@dataclass
class _Entry:
    graph: Graph  # held, so its id is not reused while the entry lives
    cuda_graph: Any = None  # torch.cuda.CUDAGraph once captured


@dataclass
class GraphRunner:
    counters: GraphCounters = field(default_factory=GraphCounters)
    _entries: OrderedDict[tuple[int, int], _Entry] = field(default_factory=OrderedDict)

    def run(self, g: Graph, ops: Ops, workspace: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        views, steps, output = bind(g, ops, workspace)
        for name, t in inputs.items():
            views[name].copy_(t)
        if views["inp_tokens"].shape[0] > GRAPH_MAX_TOKENS:
            self._count("eager")
            for step in steps:
                step()
            return output
        key = (id(g), workspace.data_ptr())
        e = self._entries.get(key)
        if e is None or e.graph is not g:
            self._entries[key] = _Entry(g)
            while len(self._entries) > MAX_GRAPHS:
                self._entries.popitem(last=False)
            self._count("eager")
            for step in steps:
                step()
            return output
        self._entries.move_to_end(key)
        if e.cuda_graph is None:
            e.cuda_graph = self.capture(steps)
            self._count("captures")
        e.cuda_graph.replay()
        self._count("replays")
        return output

    def _count(self, what: str) -> None:
        for c in (self.counters, TOTALS):
            setattr(c, what, getattr(c, what) + 1)

    @staticmethod
    def capture(steps: list) -> Any:
        """The steps recorded into a CUDA graph (nothing runs until it is replayed)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for step in steps:
                step()
        return graph

    def clear(self) -> None:
        self._entries.clear()


def runner(ops: Ops) -> GraphRunner | None:
    """The backend's runner (made on first use) when it asks for CUDA graphs, else None."""
    if not getattr(ops, "cuda_graphs", False):
        return None
    r = getattr(ops, "graph_runner", None)
    if r is None:
        r = ops.graph_runner = GraphRunner()  # type: ignore[attr-defined]
    return r


def counters(ops: Ops) -> GraphCounters | None:
    r = getattr(ops, "graph_runner", None)
    return r.counters if r is not None else None


def run_step(g: Graph, ops: Ops, workspace: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """One ubatch's forward pass: replayed from a CUDA graph when the backend asks for it."""
    r = runner(ops)
    if r is None:
        return run_graph(g, ops, workspace, inputs)
    return r.run(g, ops, workspace, inputs)
