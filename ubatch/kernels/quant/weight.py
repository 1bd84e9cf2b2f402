"""A weight as stored in the GGUF file: quantised bytes plus the type needed to read them.

The stored bytes are the only form a weight has; each backend decides how to compute with them
(the torch reference keeps its own dense copies, the CPU and GPU kernels read the blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ubatch.kernels.quant.dequant import dequantize


@dataclass(eq=False)
class QWeight:
    name: str
    raw: torch.Tensor  # uint8, the stored bytes (rows of quant blocks along ne0)
    ggml_type: int
    shape: tuple[int, ...]  # torch order: (rows, ne0) for matrices

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (of the innermost dimension)."""
        return self.raw.numel() // math.prod(self.shape[:-1])

    def expert(self, e: int) -> QWeight:
        """Expert e's matrix of a 3-D (n_expert, rows, cols) tensor: itself a valid quantised
        matrix (a view of the stored bytes)."""
        n = self.raw.numel() // self.shape[0]
        return QWeight(f"{self.name}[{e}]", self.raw[e * n : (e + 1) * n], self.ggml_type, self.shape[1:])

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A fresh dequantised copy in `dtype` (not cached: backends own their layouts)."""
        return dequantize(self.raw, self.ggml_type, self.shape, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` dequantised (embedding lookup) without needing the dense matrix."""
        raw_rows = self.raw.view(self.shape[0], self.raw.numel() // self.shape[0]).index_select(0, ids)
        return dequantize(raw_rows, self.ggml_type, (ids.numel(), *self.shape[1:]), dtype)

    def to(self, device: torch.device | str) -> QWeight:
        return QWeight(self.name, self.raw.to(device), self.ggml_type, self.shape)
