"""Recording a forward pass: a `GraphBuilder` mirrors the `Ops` methods but computes nothing.

The model code (engine/forward.py) calls its methods, each of which records a node (op, inputs,
output shape and dtype, the scratch the backend asks for) and returns a `Sym`; `finish` lays
the nodes out in one workspace (engine/graph.py `lay_out_graph`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ubatch.engine.graph.graph import Graph, Node, Sym, lay_out_graph
from ubatch.kernels.ops import KVTensor, Ops, attn_scratch
from ubatch.kernels.quant.weight import QWeight


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
