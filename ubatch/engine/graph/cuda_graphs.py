"""A ubatch's forward pass through the backend's graph runner, for decode steps replayed as CUDA graphs.

The graph of a shape key is bound to fixed workspace addresses (engine/graph/graph.py) and the
step's inputs are copied into those same views, so a runner that captured the bound calls once
(kernels/cuda/graphs.py) can replay them while the key holds. The backend owns its runner
(`Ops.graph_runner`); on the CPU, or with a backend that has none, a step is plain `run_graph`.
"""

from __future__ import annotations

from torch import Tensor

from ubatch.engine.graph.graph import Graph, bind_inputs, run_graph
from ubatch.kernels.ops import GraphCounters, Ops


def counters(ops: Ops) -> GraphCounters | None:
    """How the backend's runner ran the steps so far, or None where it has none."""
    r = ops.graph_runner
    return r.counters if r is not None else None


def run_step(g: Graph, ops: Ops, workspace: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    """One ubatch's forward pass: the backend's runner runs the bound calls where it has one."""
    r = ops.graph_runner
    # a graph that talks to other ranks runs launch by launch: collectives captured into a CUDA
    # graph have not been tried on a device yet (no GPU was lent)
    if r is None or g.talks:
        return run_graph(g, ops, workspace, inputs)
    b = bind_inputs(g, ops, workspace, inputs)
    r.run(g, workspace.data_ptr(), b.inputs["inp_tokens"].shape[0], b.steps)
    return b.output
