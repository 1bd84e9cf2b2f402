"""CUDA graphs for decode steps: a step's kernels launched once into a graph, then replayed.

A decode step of a small model is dozens of short kernels, and launching them one by one from
Python costs more than running them. The engine binds a graph of a shape key (n_tokens,
n_outputs, the groups and the padded n_kv of each cache: exactly `GraphShape`, which is why n_kv
is padded to 256) to fixed workspace addresses and copies the step's inputs into those same
views (engine/graph/cuda_graphs.py), so a captured CUDA graph stays valid while the binding
holds. The first step of a binding runs eagerly (Triton compiles its kernels then), the second
is captured, later ones replay. The CUDA backend owns one `CudaGraphRunner`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ubatch.kernels.ops import GraphCounters, Step

GRAPH_MAX_TOKENS = 64  # ubatches up to this many rows are captured (decode, -np up to 64)
MAX_GRAPHS = 16  # captured graphs kept (each holds a little private memory)

TOTALS = GraphCounters()  # every runner of the process together: `ubatch bench` reads it per test


def summary(c: GraphCounters | None) -> str:
    """The counters' line, or 'off' where no step went through a runner (on a GPU the first
    step of every shape runs eagerly, so a run there never counts nothing)."""
    if c is None or c == GraphCounters():
        return "CUDA graphs: off (the kernels run in Triton's interpreter)"
    return c.line()


@dataclass
class _Entry:
    graph: object  # held, so its id is not reused while the entry lives
    cuda_graph: torch.cuda.CUDAGraph | None = None  # once captured


@dataclass
class CudaGraphRunner:
    """The `GraphRunner` of the CUDA backend: eager, then captured, then replayed, per binding."""

    counters: GraphCounters = field(default_factory=GraphCounters)
    _entries: OrderedDict[tuple[int, int], _Entry] = field(default_factory=OrderedDict)

    def run(self, graph: object, workspace: int, rows: int, steps: Sequence[Step]) -> None:
        if rows > GRAPH_MAX_TOKENS:
            self._eager(steps)
            return
        key = (id(graph), workspace)
        e = self._entries.get(key)
        if e is None or e.graph is not graph:
            self._entries[key] = _Entry(graph)
            while len(self._entries) > MAX_GRAPHS:
                self._entries.popitem(last=False)
            self._eager(steps)
            return
        self._entries.move_to_end(key)
        if e.cuda_graph is None:
            e.cuda_graph = self.capture(steps)
            self._count("captures")
        e.cuda_graph.replay()
        self._count("replays")

    def _eager(self, steps: Sequence[Step]) -> None:
        self._count("eager")
        for step in steps:
            step()

    def _count(self, what: str) -> None:
        for c in (self.counters, TOTALS):
            setattr(c, what, getattr(c, what) + 1)

    @staticmethod
    def capture(steps: Sequence[Step]) -> torch.cuda.CUDAGraph:
        """The steps recorded into a CUDA graph (nothing runs until it is replayed)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for step in steps:
                step()
        return graph

    def clear(self) -> None:
        self._entries.clear()
