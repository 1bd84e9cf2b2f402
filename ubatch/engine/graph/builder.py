"""Recording a forward pass: a `GraphBuilder` mirrors the `Ops` methods but computes nothing.

The model code (engine/graph/forward.py) calls its methods, each of which records a node (the
op's arguments as one of kernels/ops.py's `*Args` with symbols for tensors, output shape and
dtype, the scratch the backend asks for) and returns a `Sym`; `finish` lays the nodes out in one
workspace (engine/graph/graph.py `lay_out_graph`).
"""

from __future__ import annotations

import math

import torch

from ubatch.engine.graph.graph import Graph, Node, Sym, lay_out_graph, node_inputs
from ubatch.kernels.ops import (
    AddArgs,
    AllReduceArgs,
    AttentionArgs,
    Collective,
    ColsArgs,
    ConcatArgs,
    GatherColsArgs,
    GetRowsArgs,
    GluArgs,
    KVStoreArgs,
    KVTensor,
    LinearArgs,
    LoraArgs,
    LoraStack,
    MoeSumArgs,
    MoeTopKArgs,
    MoeWeightsArgs,
    MulMatIdArgs,
    NodeArgs,
    Ops,
    RmsNormArgs,
    RopeArgs,
    RowsArgs,
    ScaleArgs,
    ScratchSpec,
    SigmoidScaleArgs,
    SoftcapArgs,
    op_decl,
)
from ubatch.kernels.quant.weight import QWeight


class GraphBuilder:
    """Records the forward pass; each method mirrors an `Ops` method but returns a Sym. The
    backend is asked for the scratch its ops need (e.g. dequantisation tiles), so that scratch
    is laid out in the workspace and counted in the compute buffer like any intermediate."""

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self.nodes: list[Node] = []
        self.inputs: dict[str, int] = {}

    def _node(
        self,
        op: str,
        args: NodeArgs[Sym] | None,
        inputs: tuple[Sym, ...],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        name: str,
        scratch: ScratchSpec | None = None,
        base: int = -1,
    ) -> Sym:
        n = Node(len(self.nodes), op, args, inputs, tuple(shape), dtype, name, scratch or [], base)
        self.nodes.append(n)
        return Sym(n.id, n.shape, dtype)

    def op(self, args: NodeArgs[Sym], name: str, scratch: ScratchSpec | None = None) -> Sym:
        """A node computing any declared op (kernels/ops.py `declare`) into a new f32 tensor of the
        shape its declaration gives."""
        d = op_decl(args)
        return self._node(d.name, args, node_inputs(args), d.shape(args), torch.float32, name, scratch)

    def input(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Sym:
        s = self._node("input", None, (), shape, dtype, name)
        self.inputs[name] = s.id
        return s

    def view(self, x: Sym, shape: tuple[int, ...], name: str = "") -> Sym:
        assert math.prod(shape) == math.prod(x.shape), (x.shape, shape)
        base = self.nodes[x.id].base if self.nodes[x.id].base >= 0 else x.id
        return self._node("view", None, (x,), shape, x.dtype, name or self.nodes[x.id].name, base=base)

    def get_rows(self, w: QWeight, ids: Sym, name: str) -> Sym:
        return self.op(GetRowsArgs(w, ids), name)

    def linear(self, x: Sym, w: QWeight, name: str) -> Sym:
        return self.op(LinearArgs(x, w), name, self.ops.linear_scratch(x.shape[0], w))

    def mul_mat_id(self, x: Sym, w: QWeight, ids: Sym, b: torch.Tensor | None, name: str) -> Sym:
        """Each (token, chosen expert) row times that expert's matrix of w (n_expert, rows, cols)."""
        n, k = ids.shape
        return self.op(MulMatIdArgs(x, w, ids, b), name, self.ops.mul_mat_id_scratch(n, k, w))

    def moe_topk(
        self, logits: Sym, k: int, gating: str, bias: torch.Tensor | None, groups: tuple[int, int], name: str
    ) -> Sym:
        """The k experts each row chooses, as int32 ids; `groups`: (n_group, n_group_used)."""
        a = MoeTopKArgs(logits, k, gating, bias, *groups)
        return self._node(op_decl(a).name, a, (logits,), (logits.shape[0], k), torch.int32, name)

    def moe_weights(self, logits: Sym, ids: Sym, gating: str, norm: bool, scale: float, name: str) -> Sym:
        return self.op(MoeWeightsArgs(logits, ids, gating, norm, scale), name)

    def moe_sum(self, x: Sym, weights: Sym, name: str) -> Sym:
        return self.op(MoeSumArgs(x, weights), name)

    def lora(self, y: Sym, x: Sym, w: LoraStack, idx: Sym, scale: Sym, sel: Sym | None, name: str) -> Sym:
        """y + each row's adapters' low-rank products on x: one segmented node (`LoraArgs`)."""
        return self.op(LoraArgs(y, x, w, idx, scale, sel), name)

    def rms_norm(self, x: Sym, w: torch.Tensor, eps: float, name: str) -> Sym:
        return self.op(RmsNormArgs(x, w, eps), name, [((*x.shape[:-1], 1), torch.float32)])

    def rope(self, x: Sym, cos: Sym, sin: Sym, neox: bool, name: str) -> Sym:
        return self.op(RopeArgs(x, cos, sin, neox), name)

    def scale(self, x: Sym, s: float, name: str) -> Sym:
        return self.op(ScaleArgs(x, s), name)

    def add(self, a: Sym, b: Sym, name: str) -> Sym:
        return self.op(AddArgs(a, b), name)

    def glu(self, gate: Sym, up: Sym, act: str, name: str) -> Sym:
        return self.op(GluArgs(gate, up, act), name)

    def rows(self, x: Sym, idx: Sym, name: str) -> Sym:
        return self.op(RowsArgs(x, idx), name)

    def cols(self, x: Sym, start: int, n: int, name: str) -> Sym:
        return self.op(ColsArgs(x, start, n), name)

    def concat(self, a: Sym, b: Sym, name: str) -> Sym:
        return self.op(ConcatArgs(a, b), name)

    def sigmoid_scale(self, x: Sym, g: Sym, name: str) -> Sym:
        return self.op(SigmoidScaleArgs(x, g), name)

    def softcap(self, x: Sym, c: float, name: str) -> Sym:
        return self.op(SoftcapArgs(x, c), name)

    def all_reduce(self, x: Sym, comm: Collective, name: str) -> Sym:
        return self.op(AllReduceArgs(x, comm), name)

    def gather_cols(self, x: Sym, comm: Collective, n: int, name: str) -> Sym:
        """(rows, c) on each rank -> (rows, n) on rank 0: the vocabulary slices side by side."""
        return self.op(GatherColsArgs(x, comm, n), name)

    def kv_store(self, store: KVTensor, slots: Sym, x: Sym, name: str) -> Sym:
        """Write rows into the cache; a half-precision cache gets a scratch for the cast."""
        dt = store.data.dtype
        scratch: ScratchSpec = [(x.shape, dt)] if dt not in (torch.float32, torch.uint8) else []
        return self.op(KVStoreArgs(store, slots, x), name, scratch)

    def attention(self, a: AttentionArgs[Sym], after: tuple[Sym, Sym], name: str) -> Sym:
        """Attention of q over the layer's KV stores; `after` (this layer's K and V stores)
        orders it behind them. The backend plans its scratch (`Ops.attention_scratch`)."""
        scratch = self.ops.attention_scratch(a.q.shape, a.k, a.v, a.n_kv)
        d = op_decl(a)
        return self._node(d.name, a, (*node_inputs(a), *after), d.shape(a), torch.float32, name, scratch)

    def finish(self, output: Sym) -> Graph:
        g = Graph(self.nodes, dict(self.inputs), output.id)
        g.talks = any(isinstance(n.args, (AllReduceArgs, GatherColsArgs)) for n in self.nodes)
        g.layout, g.scratch_keys = lay_out_graph(g)
        return g
