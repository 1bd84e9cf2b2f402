"""The abstract backend of the architectures' graphs, and the plain data the ops exchange.

Every op writes into an `out` tensor it is given (a view of the workspace) and takes any
scratch it needs as views too, so a planned forward pass allocates nothing on its own. Ops know
tensors and ggml types, never contexts: a backend (torch reference, fast CPU, CUDA) implements
`Ops` and the engine picks one by name from `kernels.backends`. Activations are f32
throughout: Gemma's residual stream reaches ~1e5, beyond fp16.

`Ops` declares every op and every capability a backend may have, each capability with a
default (binding a graph node to one call, fusing runs of calls, attention scratch, the mask
inside the attention kernel, a graph runner), so the engine reads attributes and never probes.
A graph node's inputs travel as one of the `*Args` dataclasses below, generic in what stands
for a tensor: `torch.Tensor` in a backend's hands, the graph builder's symbol while recording.
Each is declared once with its op (`declare`: the method, output shape, in-place flag, profiling
category, default binding), so a new op is its `*Args` here with a default method that hands it
to the reference (`Ops.fallback`), the reference's code in kernels/torch_ops.py, and a faster
kernel in a backend where one pays.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

import numpy as np
import torch
from torch import Tensor

from ubatch.kernels.quant.weight import QWeight

KV_CHUNK = 256  # cells per attention step (n_kv is always a multiple of 256)
MASKED = -1e30  # running-max floor: rows that have seen only masked cells stay finite

ScratchSpec = list[tuple[tuple[int, ...], torch.dtype]]
Step = Callable[[], object]  # one bound node: every input, output and scratch resolved
X = TypeVar("X")  # what stands for a tensor in node arguments: a Tensor, or a graph symbol


@dataclass(eq=False)
class KVTensor:
    """One layer's K or V rows for every cell: float (cells, heads, d) or quantised
    (cells, row bytes) data, and the ggml type that says how to read it."""

    data: Tensor
    ggml_type: int
    n_head: int
    head_dim: int


ATTN_TILE_ROWS = 512  # query rows (token x head) per score tile: 512 x 256 cells = 512 KiB


def query_block(t: int, r: int) -> int:
    """Tokens per score tile when r query heads share a KV head."""
    return max(1, min(t, ATTN_TILE_ROWS // r))


TRIM_MIN_TOKENS = 32  # query blocks at least this tall skip the cells none of their rows see


def attn_scratch(g: int, t: int, n_head: int, n_head_kv: int, n_kv: int, d: int, dv: int) -> ScratchSpec:
    """Scratch of the reference attention: one chunk of K and V in f32, the score tile for one
    block of queries and one chunk of cells, the running max and sum per query row, and for GQA
    (n_head_kv > 1) head-major copies of q and of the output. Nothing grows with the context,
    and the score tile stops growing with the ubatch at ATTN_TILE_ROWS rows."""
    r, c, b = n_head // n_head_kv, min(KV_CHUNK, n_kv), g * n_head_kv
    rows = query_block(t, r) * r
    out: ScratchSpec = [
        ((b, c, d), torch.float32),
        ((b, c, dv), torch.float32),
        ((b, rows, c), torch.float32),
        ((b, t * r, 1), torch.float32),
        ((b, t * r, 1), torch.float32),
        ((b, rows, 1), torch.float32),
    ]
    if n_head_kv > 1:
        out += [((g, n_head_kv, t, r, d), torch.float32), ((g, n_head_kv, t, r, dv), torch.float32)]
    return out


def attn_scratch_count(n_head_kv: int) -> int:
    """How many of attn_scratch's buffers there are: a backend's own come after them."""
    return 6 if n_head_kv == 1 else 8


# -- a graph node's inputs, each with its op declared once ------------------------------------------
A = TypeVar("A")


@dataclass(frozen=True, slots=True)
class OpDecl:
    """What the graph and every backend know of an op, declared with its argument type: the `Ops`
    method that computes it, its output's shape from the arguments, whether the output may take
    over the first input's memory, the profiling category, and how a backend without its own
    kernel binds a node to its method (`Ops.bind`)."""

    name: str
    shape: Callable[[Any], tuple[int, ...]]  # the arguments (symbols or tensors) -> the output's shape
    bind: Callable[[Ops, Any, Tensor, list[Tensor]], Step]  # (backend, arguments, out, scratch) -> one call
    category: str
    inplace: bool = False


OPS: dict[type, OpDecl] = {}


def declare(
    name: str,
    shape: Callable[[Any], tuple[int, ...]],
    bind: Callable[[Ops, Any, Tensor, list[Tensor]], Step],
    category: str,
    inplace: bool = False,
) -> Callable[[type[A]], type[A]]:
    """Registers an argument type's op (see `OpDecl`)."""

    def register(cls: type[A]) -> type[A]:
        OPS[cls] = OpDecl(name, shape, bind, category, inplace)
        return cls

    return register


def _same(a: Any) -> tuple[int, ...]:
    """The output has the first input's shape."""
    return tuple(a.x.shape)


@declare(
    "get_rows",
    lambda a: (a.ids.shape[0], a.w.shape[1]),
    lambda o, a, out, s: functools.partial(o.get_rows, a.w, a.ids, out),
    "rows",
)
@dataclass(slots=True)
class GetRowsArgs(Generic[X]):
    w: QWeight
    ids: X


@declare(
    "linear",
    lambda a: (a.x.shape[0], a.w.shape[0]),
    lambda o, a, out, s: functools.partial(o.linear, a.x, a.w, out, s),
    "matmul",
)
@dataclass(slots=True)
class LinearArgs(Generic[X]):
    x: X
    w: QWeight


@declare("rms_norm", _same, lambda o, a, out, s: functools.partial(o.rms_norm, a.x, a.w, a.eps, out, s), "norm")
@dataclass(slots=True)
class RmsNormArgs(Generic[X]):
    x: X
    w: Tensor  # a weight of the model, never a graph tensor
    eps: float


@declare("rope", _same, lambda o, a, out, s: functools.partial(o.rope, a.x, a.cos, a.sin, a.neox, out), "rope")
@dataclass(slots=True)
class RopeArgs(Generic[X]):
    x: X
    cos: X
    sin: X
    neox: bool


@declare("scale", _same, lambda o, a, out, s: functools.partial(o.scale, a.x, a.s, out), "elementwise", inplace=True)
@dataclass(slots=True)
class ScaleArgs(Generic[X]):
    x: X
    s: float


@declare(
    "add",
    lambda a: tuple(a.a.shape),
    lambda o, a, out, s: functools.partial(o.add, a.a, a.b, out),
    "elementwise",
    inplace=True,
)
@dataclass(slots=True)
class AddArgs(Generic[X]):
    a: X
    b: X


@declare(
    "glu",
    lambda a: tuple(a.gate.shape),
    lambda o, a, out, s: functools.partial(o.glu, a.gate, a.up, a.act, out),
    "elementwise",
    inplace=True,
)
@dataclass(slots=True)
class GluArgs(Generic[X]):
    gate: X
    up: X
    act: str


@declare(
    "add_bias", _same, lambda o, a, out, s: functools.partial(o.add_bias, a.x, a.b, out), "elementwise", inplace=True
)
@dataclass(slots=True)
class BiasArgs(Generic[X]):
    """A projection's bias added to each of its rows (qwen2's Q/K/V)."""

    x: X
    b: Tensor  # a weight of the model (f32), never a graph tensor


@dataclass(eq=False, slots=True)
class LoraStack:
    """One targeted matrix's LoRA pairs for every loaded adapter, side by side as the segmented
    kernels read them (Punica's BGMV layout): A (n_adapters, R, n_in) and Bᵀ (n_adapters, R, n_out)
    in one float dtype, zero-padded to the largest rank R; per adapter its rank (0: it does not
    target this matrix) and its constant c = alpha / rank (llama.cpp's get_scale)."""

    a: Tensor
    bt: Tensor
    rank: Tensor  # (n_adapters,) int32
    c: Tensor  # (n_adapters,) f32


@declare(
    "lora", lambda a: tuple(a.y.shape), lambda o, a, out, s: functools.partial(o.lora, a, out), "matmul", inplace=True
)
@dataclass(slots=True)
class LoraArgs(Generic[X]):
    """y + Σ_j c[k] · scale[r, j] · B_k (A_k x[r]) with k = idx[r, j], per row r of x: each row
    gathers its own adapters' pairs (a segmented low-rank product, one call for all adapters of a
    ubatch); slots with k < 0 are skipped. `sel` (rows of idx/scale that x's rows are: the output
    rows past the last layer's cut) or None. A row's result never depends on the other rows."""

    y: X
    x: X
    w: LoraStack
    idx: X  # (n, m) int32: the adapters each row applies, -1 padded
    scale: X  # (n, m) f32: their user scales
    sel: X | None = None  # (n_x,) int64


@declare(
    "rows",
    lambda a: (a.idx.shape[0], *a.x.shape[1:]),
    lambda o, a, out, s: functools.partial(o.rows, a.x, a.idx, out),
    "rows",
)
@dataclass(slots=True)
class RowsArgs(Generic[X]):
    x: X
    idx: X


@declare(
    "softcap", _same, lambda o, a, out, s: functools.partial(o.softcap, a.x, a.c, out), "elementwise", inplace=True
)
@dataclass(slots=True)
class SoftcapArgs(Generic[X]):
    x: X
    c: float


@declare(
    "kv_store", lambda a: (0,), lambda o, a, out, s: functools.partial(o.kv_store, a.kv, a.cells, a.x, s), "kv_write"
)
@dataclass(slots=True)
class KVStoreArgs(Generic[X]):
    kv: KVTensor
    cells: X
    x: X


class Collective(Protocol):
    """What a graph of one tensor-parallel rank exchanges with the other ranks (engine/parallel
    implements it over torch.distributed). Backends call it; they never see the process group."""

    @property
    def rank(self) -> int: ...
    @property
    def world(self) -> int: ...

    def all_reduce(self, x: Tensor) -> None:
        """Sum x over the ranks, in place."""

    def gather_cols(self, x: Tensor, out: Tensor) -> None:
        """Rank 0's `out` (rows, n) gets every rank's x (rows, c) side by side, cut to n columns;
        on the other ranks `out` is left as it is."""


@declare(
    "all_reduce",
    _same,
    lambda o, a, out, s: functools.partial(all_reduce, a.x, a.comm, out),
    "collective",
    inplace=True,
)
@dataclass(slots=True)
class AllReduceArgs(Generic[X]):
    """Partial sums of a row-split product (attention output, FFN down, the vocabulary's
    embedding rows) made whole on every rank."""

    x: X
    comm: Collective


@declare(
    "gather_cols",
    lambda a: (a.x.shape[0], a.n),
    lambda o, a, out, s: functools.partial(a.comm.gather_cols, a.x, out),
    "collective",
)
@dataclass(slots=True)
class GatherColsArgs(Generic[X]):
    """Each rank's logits for its slice of the vocabulary, side by side on rank 0."""

    x: X
    comm: Collective
    n: int  # the columns of the whole (the vocabulary)


@declare(
    "cols", lambda a: (*a.x.shape[:-1], a.n), lambda o, a, out, s: functools.partial(o.cols, a.x, a.start, out), "rows"
)
@dataclass(slots=True)
class ColsArgs(Generic[X]):
    """Columns [start, start + n) of x's last dimension, contiguous (multi-head latent attention
    splits each head's q and the compressed KV row into their no-RoPE and RoPE parts)."""

    x: X
    start: int
    n: int


@declare(
    "concat",
    lambda a: (*a.a.shape[:-1], a.a.shape[-1] + a.b.shape[-1]),
    lambda o, a, out, s: functools.partial(o.concat, a.a, a.b, out),
    "rows",
)
@dataclass(slots=True)
class ConcatArgs(Generic[X]):
    """a and b side by side along the last dimension (the other dimensions equal)."""

    a: X
    b: X


@declare(
    "sigmoid_scale",
    _same,
    lambda o, a, out, s: functools.partial(o.sigmoid_scale, a.x, a.g, out),
    "elementwise",
    inplace=True,
)
@dataclass(slots=True)
class SigmoidScaleArgs(Generic[X]):
    """Each row of x times sigmoid of its gate logit g (n, 1): qwen2moe's shared-expert gate."""

    x: X
    g: X


def _expert_rows(a: Any) -> tuple[int, ...]:
    """mul_mat_id's output: one row of the expert's product per (token, chosen expert)."""
    return (a.ids.shape[0], a.ids.shape[1], a.w.shape[1])


@declare("mul_mat_id", _expert_rows, lambda o, a, out, s: functools.partial(o.mul_mat_id, a, out, s), "matmul")
@dataclass(slots=True)
class MulMatIdArgs(Generic[X]):
    """llama.cpp's mul_mat_id: out[t, j] = w[ids[t, j]] · x[t, j] (+ b[ids[t, j]]), where w is
    (n_expert, rows, cols) as stored and x is (n, 1, cols) (every chosen expert reads the token's
    row) or (n, k, cols) (one row per chosen expert). A backend groups the rows by expert so that
    each chosen expert's matrix is read once per call and no other expert's at all."""

    x: X
    w: QWeight
    ids: X  # (n, k) int32: the experts each token's router chose
    b: Tensor | None = None  # (n_expert, rows) f32: each expert's bias (gpt-oss)


@declare(
    "moe_topk", lambda a: (a.logits.shape[0], a.k), lambda o, a, out, s: functools.partial(o.moe_topk, a, out), "rows"
)
@dataclass(slots=True)
class MoeTopKArgs(Generic[X]):
    """The k experts each row of router logits (n, n_expert) chooses: the largest gating
    probabilities (softmax, or sigmoid plus the selection bias where the family has one), as
    int32 ids (n, k). With groups (DeepSeek-V3, llama.cpp's build_moe_ffn), only among the
    n_group_used groups (of n_group equal runs of experts) whose two best probabilities sum
    highest."""

    logits: X
    k: int
    gating: str  # "softmax", "sigmoid", "softmax_weight" (chosen on the raw logits)
    bias: Tensor | None = None  # (n_expert,) added to the probabilities for the choice only
    n_group: int = 1  # 1: no groups
    n_group_used: int = 1


@declare(
    "moe_weights",
    lambda a: tuple(a.ids.shape),
    lambda o, a, out, s: functools.partial(o.moe_weights, a, out),
    "elementwise",
)
@dataclass(slots=True)
class MoeWeightsArgs(Generic[X]):
    """The chosen experts' weights (n, k): their gating probabilities (softmax_weight: a softmax
    over the chosen logits only), divided by their sum where `norm`, times `scale`."""

    logits: X
    ids: X
    gating: str
    norm: bool
    scale: float


@declare(
    "moe_sum",
    lambda a: (a.x.shape[0], a.x.shape[2]),
    lambda o, a, out, s: functools.partial(o.moe_sum, a.x, a.weights, out),
    "elementwise",
)
@dataclass(slots=True)
class MoeSumArgs(Generic[X]):
    """Each token's chosen experts' outputs x (n, k, d) summed with their weights (n, k)."""

    x: X
    weights: X


@dataclass(slots=True)
class MaskCells(Generic[X]):
    """What a backend with `mask_in_kernel` computes the mask from, instead of a [n_tokens, n_kv]
    tensor: a query sees a cell that is not empty, shares one of its sequences, is not in its
    future (its causal limit) and lies inside the sliding window (engine/kv/cache.py's rules)."""

    cell_pos: X  # (G, n_kv) int32, -1 where empty
    cell_seq: X  # (G, n_kv) int64, the cell's sequences as bits
    query_pos: X  # (G·T,) int32
    query_seq: X  # (G·T,) int64, the query's sequence as one bit
    n_swa: int  # 0: no window
    query_lim: X  # (G·T,) int32: the last position a query sees (INT32_MAX: not causal)


@declare(
    "attention",
    lambda a: (a.q.shape[0] * a.q.shape[1], a.q.shape[2] * a.v.head_dim),
    lambda o, a, out, s: functools.partial(o.attention, a, out, s),
    "attention",
)
@dataclass(slots=True)
class AttentionArgs(Generic[X]):
    """softmax(scale·q·kᵀ + mask)·v over the layer's KV stores. q (G, T, H, D), one group per KV
    stream; cells [s, s + n_kv) of each stream start at `starts` (G,); the mask is the additive
    (G, T, n_kv) f16 tensor, or None with `cells` where the backend masks in its kernel;
    `visible[i]` False: no query sees a cell of 256-cell chunk i. Query head h reads KV head
    h // (H / Hkv) (GQA)."""

    q: X
    k: KVTensor
    v: KVTensor
    starts: X
    n_kv: int
    mask: X | None
    scale: float
    visible: X | None = None
    cells: MaskCells[X] | None = None
    softcap: float = 0.0  # scores become softcap·tanh(scores / softcap) before scale and mask (gemma2); 0: off
    # (H,) f32: each query head's sink, a logit in the softmax's denominator with no value (gpt-oss)
    sinks: Tensor | None = None


NodeArgs: TypeAlias = (
    GetRowsArgs[X]
    | LinearArgs[X]
    | RmsNormArgs[X]
    | RopeArgs[X]
    | ScaleArgs[X]
    | AddArgs[X]
    | GluArgs[X]
    | RowsArgs[X]
    | LoraArgs[X]
    | SoftcapArgs[X]
    | BiasArgs[X]
    | KVStoreArgs[X]
    | AttentionArgs[X]
    | AllReduceArgs[X]
    | GatherColsArgs[X]
    | MulMatIdArgs[X]
    | MoeTopKArgs[X]
    | MoeWeightsArgs[X]
    | MoeSumArgs[X]
    | ColsArgs[X]
    | ConcatArgs[X]
    | SigmoidScaleArgs[X]
)


def op_decl(a: NodeArgs[X]) -> OpDecl:
    """The declaration of the op a node's arguments are for."""
    return OPS[type(a)]


def op_name(a: NodeArgs[X]) -> str:
    """The `Ops` method a node's arguments are for."""
    return OPS[type(a)].name


INPLACE_OPS = frozenset(d.name for d in OPS.values() if d.inplace)  # output may take over the first input


def all_reduce(x: Tensor, comm: Collective, out: Tensor) -> None:
    """The sum over the ranks into `out` (which may be x itself: the op is in place)."""
    if out.data_ptr() != x.data_ptr():
        out.copy_(x)
    comm.all_reduce(out)


# -- the graph runner -----------------------------------------------------------------------------
@dataclass(slots=True)
class GraphCounters:
    """How a backend's runner ran the steps: what the performance summary and `ubatch bench` report."""

    captures: int = 0
    replays: int = 0
    eager: int = 0  # steps run launch by launch (first sight of a key, prefill)

    def line(self) -> str:
        return f"CUDA graphs: {self.captures} captured, {self.replays} replays, {self.eager} steps launched eagerly"

    def since(self, before: GraphCounters) -> GraphCounters:
        """The counts added after `before` (a copy taken earlier)."""
        return GraphCounters(self.captures - before.captures, self.replays - before.replays, self.eager - before.eager)


class GraphRunner(Protocol):
    """Runs a bound graph's steps its own way: the CUDA backend replays decode steps as CUDA
    graphs (kernels/cuda/graphs.py). `graph` and `workspace` (its address) say which binding the
    steps are, `rows` how many tokens the step computes."""

    counters: GraphCounters

    def run(self, graph: object, workspace: int, rows: int, steps: Sequence[Step]) -> None: ...


def argmax_rows(logits: Tensor) -> list[int]:
    """Each row's first maximum as numpy's argmax finds it (a NaN wins): a greedy row's token.
    `logits`: float32 rows in host memory."""
    return np.argmax(logits.numpy(), axis=1).tolist()


# -- the backend ----------------------------------------------------------------------------------
class Ops(ABC):
    """A backend: every op, abstract, and every capability, with its default. `out` may alias
    the first input where noted."""

    name: str
    notices: list[str]  # things the user should know (missing kernels, portable fallback)
    # True: attention computes the mask from the cells' positions and sequence bits
    # (`AttentionArgs.cells`), so the graph declares no [n_tokens, n_kv] mask tensor
    mask_in_kernel: bool = False
    cuda_graphs: bool = False  # decode steps are captured and replayed (`graph_runner`)
    dispatch: tuple[str, ...] = ()  # why the backend runs the kernels it does, where it chose by measurement

    @property
    def graph_runner(self) -> GraphRunner | None:
        """The backend's own runner of bound steps (engine/graph/cuda_graphs.py), or None: the
        steps run one after the other."""
        return None

    def fallback(self) -> Ops:
        """The backend this one hands an op it has no kernel for: the torch reference a CPU or
        CUDA backend composes. An op declared with a default method below runs there unless the
        backend overrides it."""
        raise NotImplementedError(f"the {self.name} backend has no reference backend to hand an op to")

    # weights: the backend owns their layout and says what it holds beyond the file's bytes
    @abstractmethod
    def prepare_weights(self, weights: list[QWeight]) -> None: ...
    @abstractmethod
    def held_bytes(self) -> int: ...
    @abstractmethod
    def kernel_path(self, ggml_type: int) -> str: ...
    @abstractmethod
    def linear_scratch(self, m: int, w: QWeight) -> ScratchSpec: ...

    def extra_read_bytes(self) -> int:
        """Bytes a pass over every weight reads beyond the stored ones (repacked copies)."""
        return 0

    def attention_scratch(self, q: tuple[int, ...], k: KVTensor, v: KVTensor, n_kv: int) -> ScratchSpec:
        """The scratch of an attention node for q's shape (G, T, H, D): the reference's tiles."""
        g, t, h, d = q
        return attn_scratch(g, t, h, k.n_head, n_kv, d, v.head_dim)

    # ops
    @abstractmethod
    def get_rows(self, w: QWeight, ids: Tensor, out: Tensor) -> Tensor: ...
    @abstractmethod
    def linear(self, x: Tensor, w: QWeight, out: Tensor, scratch: list[Tensor] | None = None) -> Tensor: ...
    @abstractmethod
    def rms_norm(self, x: Tensor, w: Tensor, eps: float, out: Tensor, scratch: list[Tensor]) -> Tensor: ...
    @abstractmethod
    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, neox: bool, out: Tensor) -> Tensor: ...
    @abstractmethod
    def scale(self, x: Tensor, s: float, out: Tensor) -> Tensor: ...  # in place ok
    @abstractmethod
    def add(self, a: Tensor, b: Tensor, out: Tensor) -> Tensor: ...  # in place ok
    @abstractmethod
    def glu(self, gate: Tensor, up: Tensor, act: str, out: Tensor) -> Tensor: ...
    @abstractmethod
    def rows(self, x: Tensor, idx: Tensor, out: Tensor) -> Tensor: ...
    @abstractmethod
    def softcap(self, x: Tensor, c: float, out: Tensor) -> Tensor: ...

    # sampling: greedy rows choose on the host, from the output buffer the step wrote
    def argmax_rows(self, logits: Tensor) -> list[int]:
        return argmax_rows(logits)

    # ops declared with a default: the reference's code unless a backend has its own kernel
    def add_bias(self, x: Tensor, b: Tensor, out: Tensor) -> Tensor:  # in place ok
        return self.fallback().add_bias(x, b, out)

    # mixtures of experts: the router's choice and weights, the chosen experts' products, their sum
    def mul_mat_id(self, a: MulMatIdArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        return self.fallback().mul_mat_id(a, out, scratch)

    def mul_mat_id_scratch(self, n: int, k: int, w: QWeight) -> ScratchSpec:
        """The scratch of a mul_mat_id node over n tokens choosing k experts each (none here)."""
        return []

    def moe_topk(self, a: MoeTopKArgs[Tensor], out: Tensor) -> Tensor:
        return self.fallback().moe_topk(a, out)

    def moe_weights(self, a: MoeWeightsArgs[Tensor], out: Tensor) -> Tensor:
        return self.fallback().moe_weights(a, out)

    def moe_sum(self, x: Tensor, weights: Tensor, out: Tensor) -> Tensor:
        return self.fallback().moe_sum(x, weights, out)

    def lora(self, a: LoraArgs[Tensor], out: Tensor) -> Tensor:  # out may be a.y
        return self.fallback().lora(a, out)

    # multi-head latent attention: a head's parts apart and together (copies; small next to attention)
    def cols(self, x: Tensor, start: int, out: Tensor) -> Tensor:
        return self.fallback().cols(x, start, out)

    def concat(self, a: Tensor, b: Tensor, out: Tensor) -> Tensor:
        return self.fallback().concat(a, b, out)

    def sigmoid_scale(self, x: Tensor, g: Tensor, out: Tensor) -> Tensor:  # in place ok
        return self.fallback().sigmoid_scale(x, g, out)

    # the KV cache: rows in the cache's ggml type (f32 / f16 / bf16 / q8_0 / q4_0)
    @abstractmethod
    def kv_store(self, kv: KVTensor, cells: Tensor, x: Tensor, scratch: list[Tensor] | None = None) -> None: ...
    @abstractmethod
    def kv_rows(self, kv: KVTensor, cells: Tensor) -> Tensor: ...
    @abstractmethod
    def attention(self, a: AttentionArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Tensor:
        """out (G·T, H·Dv); scratch as `attention_scratch` planned it."""

    @abstractmethod
    def rope_cache(
        self, pos: Tensor, n_rot: int, base: float, scale: float, freq_factors: Tensor | None = None
    ) -> tuple[Tensor, Tensor]: ...

    # running a graph
    def bind(self, a: NodeArgs[Tensor], out: Tensor, scratch: list[Tensor]) -> Step:
        """A graph node as one zero-argument call, made once per graph: a backend compiles the
        nodes it can (the CPU's C calls, CUDA's fused kernels); here, its method bound as the op's
        declaration says."""
        return OPS[type(a)].bind(self, a, out, scratch)

    def fuse(self, steps: Sequence[Step]) -> list[Step]:
        """Runs of bound calls as fewer calls where the backend can (the CPU's C calls become
        one ctypes call per run); here, the steps as they are."""
        return list(steps)
