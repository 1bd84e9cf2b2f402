"""A weight as stored in the GGUF file: quantised bytes plus the type needed to read them.

The quantised bytes are the canonical form (a GPU kernel can consume them directly); the torch
path asks for a dense copy in its compute dtype, made once and cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dequant import dequantize


@dataclass(eq=False)
class QWeight:
    name: str
    raw: torch.Tensor  # uint8, the stored bytes (rows of quant blocks along ne0)
    ggml_type: int
    shape: tuple[int, ...]  # torch order: (rows, ne0) for matrices
    _dense: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantised copy in `dtype`, cached so that a forward pass never re-dequantises."""
        t = self._dense.get(dtype)
        if t is None:
            t = dequantize(self.raw, self.ggml_type, self.shape, dtype)
            self._dense[dtype] = t
        return t

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` dequantised (embedding lookup) without needing the dense matrix."""
        if dtype in self._dense:
            return self._dense[dtype].index_select(0, ids)
        row_bytes = self.raw.numel() // self.shape[0]
        raw_rows = self.raw.view(self.shape[0], row_bytes).index_select(0, ids)
        return dequantize(raw_rows, self.ggml_type, (ids.numel(), *self.shape[1:]), dtype)

    def to(self, device: torch.device | str) -> QWeight:
        return QWeight(self.name, self.raw.to(device), self.ggml_type, self.shape)
