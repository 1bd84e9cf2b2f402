"""The op interface of llama / gemma3 graphs, and the plain data the ops exchange.

Every op writes into an `out` tensor it is given (a view of the workspace) and takes any
scratch it needs as views too, so a planned forward pass allocates nothing on its own. Ops know
tensors and ggml types, never contexts: a backend (torch reference, fast CPU, CUDA) implements
this protocol and the engine picks one by name from `kernels.backends`. Activations are f32
throughout: Gemma's residual stream reaches ~1e5, beyond fp16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ubatch.kernels.quant.weight import QWeight

KV_CHUNK = 256  # cells per attention step (n_kv is always a multiple of 256)
MASKED = -1e30  # running-max floor: rows that have seen only masked cells stay finite

ScratchSpec = list[tuple[tuple[int, ...], torch.dtype]]


@dataclass(eq=False)
class KVTensor:
    """One layer's K or V rows for every cell: float (cells, heads, d) or quantised
    (cells, row bytes) data, and the ggml type that says how to read it."""

    data: torch.Tensor
    ggml_type: int
    n_head: int
    head_dim: int


ATTN_TILE_ROWS = 512  # query rows (token x head) per score tile: 512 x 256 cells = 512 KiB


def query_block(t: int, r: int) -> int:
    """Tokens per score tile when r query heads share a KV head."""
    return max(1, min(t, ATTN_TILE_ROWS // r))


TRIM_MIN_TOKENS = 32  # query blocks at least this tall skip the cells none of their rows see


def attn_scratch(g: int, t: int, n_head: int, n_head_kv: int, n_kv: int, d: int, dv: int) -> ScratchSpec:
    """Scratch of the attention op: one chunk of K and V in f32, the score tile for one block of
    queries and one chunk of cells, the running max and sum per query row, and for GQA
    (n_head_kv > 1) head-major copies of q and of the output. Nothing grows with the context,
    and the score tile stops growing with the ubatch at ATTN_TILE_ROWS rows."""
    r, c, b = n_head // n_head_kv, min(KV_CHUNK, n_kv), g * n_head_kv
    rows = query_block(t, r) * r
    out = [
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


class Ops(Protocol):
    """A backend. `out` may alias the first input where noted."""

    name: str
    notices: list[str]  # things the user should know (missing kernels, portable fallback)
    # True: attention computes the mask from the cells' positions and sequence bits (`cells`),
    # so the graph declares no [n_tokens, n_kv] mask tensor (engine/forward.py)
    mask_in_kernel: bool

    # weights: the backend owns their layout and says what it holds beyond the file's bytes
    def prepare_weights(self, weights: list[QWeight]) -> None: ...
    def held_bytes(self) -> int: ...
    def kernel_path(self, ggml_type: int) -> str: ...
    def linear_scratch(self, m: int, w: QWeight) -> ScratchSpec: ...

    def get_rows(self, w: QWeight, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...
    def linear(
        self, x: torch.Tensor, w: QWeight, out: torch.Tensor, scratch: list[torch.Tensor] | None = None
    ) -> torch.Tensor: ...
    def rms_norm(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor, scratch: list[torch.Tensor]
    ) -> torch.Tensor: ...
    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool, out: torch.Tensor
    ) -> torch.Tensor: ...
    def scale(self, x: torch.Tensor, s: float, out: torch.Tensor) -> torch.Tensor: ...  # in place ok
    def add(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...  # in place ok
    def glu(self, gate: torch.Tensor, up: torch.Tensor, act: str, out: torch.Tensor) -> torch.Tensor: ...
    def rows(self, x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...
    def softcap(self, x: torch.Tensor, c: float, out: torch.Tensor) -> torch.Tensor: ...

    # the KV cache: rows in the cache's ggml type (f32 / f16 / bf16 / q8_0 / q4_0)
    def kv_store(
        self, kv: KVTensor, cells: torch.Tensor, x: torch.Tensor, scratch: list[torch.Tensor] | None = None
    ) -> None: ...
    def kv_chunk(self, kv: KVTensor, start: int, n: int, out: torch.Tensor) -> torch.Tensor: ...
    def kv_rows(self, kv: KVTensor, cells: torch.Tensor) -> torch.Tensor: ...
    def attention(
        self,
        q: torch.Tensor,
        k: KVTensor,
        v: KVTensor,
        starts: torch.Tensor,
        n_kv: int,
        mask: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        scratch: list[torch.Tensor],
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
    def rope_cache(
        self, pos: torch.Tensor, n_rot: int, base: float, scale: float, freq_factors: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
