"""Typed reads of GGUF metadata: every value a loader trusts is checked for type and range here.

A file is input like any other: a string where a count belongs, a NaN epsilon, a head count of
0 or a layer count of 10^9 must stop the load with one line naming the file, the key, the value
and what was expected, before anything is sized from it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import TypeGuard

import numpy as np
import numpy.typing as npt

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.string_array import StringArray

# A value as open_gguf returns it: a scalar, an array as a list of scalars, or a vocabulary-sized
# array kept compact (numbers as numpy, texts as a StringArray). GGUF has no nested arrays.
MetaScalar = bool | int | float | str
MetaValue = MetaScalar | list[MetaScalar] | npt.NDArray[np.generic] | StringArray
Metadata = dict[str, MetaValue]


class _Required(enum.Enum):
    KEY = "required"


MISSING = _Required.KEY  # sentinel default: the key is required


def show(value: object) -> str:
    """A value as the error line shows it: short, one line."""
    if isinstance(value, np.ndarray):
        return f"<array of {value.size} {value.dtype}>"
    if isinstance(value, list) and len(value) > 8:
        return f"<array of {len(value)}: {', '.join(repr(v) for v in value[:4])}, ...>"
    s = repr(value)
    return s if len(s) <= 80 else s[:77] + "..."


def bad_value(source: str, key: str, value: object, expected: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: metadata {key} = {show(value)}: expected {expected}; the file is corrupt")


def is_int(v: object) -> TypeGuard[int | np.integer]:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _raw(meta: Mapping[str, object], key: str, source: str, default: object) -> object:
    if key in meta:
        return meta[key]
    if default is MISSING:
        raise ModelLoadError(f"{source}: required metadata key {key!r} is missing; the GGUF is incomplete")
    return default


def check_int(source: str, key: str, v: object, lo: int = 1, hi: int = 1 << 31) -> int:
    if not is_int(v) or not lo <= v <= hi:
        raise bad_value(source, key, v, f"an integer in [{lo}, {hi}]")
    return int(v)


def meta_int(
    meta: Mapping[str, object], key: str, source: str, default: object = MISSING, lo: int = 1, hi: int = 1 << 31
) -> int:
    return check_int(source, key, _raw(meta, key, source, default), lo, hi)


def meta_float(
    meta: Mapping[str, object],
    key: str,
    source: str,
    default: object = MISSING,
    *,
    positive: bool = False,
    lo: float = 0.0,
) -> float:
    """A finite number (ints accepted), > 0 with `positive`, else >= lo."""
    v = _raw(meta, key, source, default)
    if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)):
        f = float(v)
        if math.isfinite(f) and (f > 0 if positive else f >= lo):
            return f
    raise bad_value(source, key, v, "a finite number > 0" if positive else f"a finite number >= {lo:g}")


def meta_str(meta: Mapping[str, object], key: str, source: str, default: object = MISSING) -> str:
    v = _raw(meta, key, source, default)
    if not isinstance(v, str):
        raise bad_value(source, key, v, "a string")
    return v


def meta_bool(meta: Mapping[str, object], key: str, source: str, default: bool) -> bool:
    v = _raw(meta, key, source, default)
    if not isinstance(v, (bool, np.bool_)) and not (is_int(v) and v in (0, 1)):
        raise bad_value(source, key, v, "a boolean")
    return bool(v)


def meta_per_layer(
    meta: Mapping[str, object],
    key: str,
    source: str,
    n_layer: int,
    default: object = MISSING,
    lo: int = 1,
    hi: int = 1 << 31,
) -> int:
    """llama.cpp allows a per-layer array for head counts and n_ff; we need one value for all."""
    v = _raw(meta, key, source, default)
    if isinstance(v, (list, np.ndarray)):
        if len(v) != n_layer:
            raise bad_value(source, key, v, f"one value or an array of block_count = {n_layer} values")
        vals = {check_int(source, key, x, lo, hi) for x in v}
        if len(vals) != 1:
            raise ModelLoadError(f"{source}: per-layer {key} values differ; such models are not supported")
        return vals.pop()
    return check_int(source, key, v, lo, hi)
