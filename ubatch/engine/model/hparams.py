"""Typed model hyperparameters read from GGUF metadata, by the architecture's own module.

Follows llama.cpp's loader: defaults for absent keys, every value checked for type and range
before anything is sized from it (engine/model/archs/base.py `read_core`, then the architecture's
own fields, reference/gguf-models.md §1.2, §3).
"""

from __future__ import annotations

from collections.abc import Mapping

from ubatch.engine.model.archs import SUPPORTED_ARCHS, arch_of
from ubatch.engine.model.archs.base import LLAMA_MAX_LAYERS, MAX_DIM, MAX_VOCAB, POOLING_TYPES, HParams

__all__ = [
    "HParams",
    "hparams_from_metadata",
    "SUPPORTED_ARCHS",
    "LLAMA_MAX_LAYERS",
    "MAX_DIM",
    "MAX_VOCAB",
    "POOLING_TYPES",
]


def hparams_from_metadata(meta: Mapping[str, object], source: str = "model") -> HParams:
    """Every value checked for type and range before anything is sized from it."""
    return arch_of(meta, source).read_hparams(meta, source)
