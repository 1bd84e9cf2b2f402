"""A timing proxy around any op backend, for `ubatch bench --profile`.

It lives with the kernels because it only knows the `Ops` protocol: it wraps a backend, passes
every call through, and adds up wall-clock time per op category. The bench turns those sums into
its "where the time goes" table; nothing in a normal run pays for the timers. A timed node is a
Python closure, so a profiled graph runs every node as its own call (the backend cannot fuse
runs of C calls into one, `Ops.fuse`): the per-call overhead a normal run no longer pays shows
up in each op's category.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ubatch.kernels.ops import Ops

# op method -> category; `linear` with the output matrix is split out as "lm_head"
OP_CATEGORY = {
    "linear": "matmul",
    "attention": "attention",
    "kv_chunk": "attention",
    "rms_norm": "norm",
    "rope": "rope",
    "rope_cache": "rope",
    "scale": "elementwise",
    "add": "elementwise",
    "glu": "elementwise",
    "softcap": "elementwise",
    "get_rows": "rows",
    "rows": "rows",
    "kv_store": "kv_write",
}
CATEGORIES = ("matmul", "lm_head", "attention", "norm", "rope", "elementwise", "kv_write", "rows", "overhead")
CATEGORY_TITLES = {
    "matmul": "matmul (layers)",
    "lm_head": "matmul (output)",
    "attention": "attention",
    "norm": "norms",
    "rope": "rope",
    "elementwise": "act/add/scale",
    "kv_write": "KV writes",
    "rows": "embd/rows",
    "overhead": "Python/graph",
}


def _timed(name: str, category: str) -> Callable:
    def method(self: ProfilingOps, *args: Any, **kwargs: Any) -> Any:
        base = getattr(self.inner, name)
        if not self.active or self._depth:
            return base(*args, **kwargs)
        self._depth += 1
        t0 = time.perf_counter_ns()
        try:
            return base(*args, **kwargs)
        finally:
            cat = category
            if name == "linear" and getattr(args[1], "name", "") in self.lm_head_names:
                cat = "lm_head"
            self.ns[cat] += time.perf_counter_ns() - t0
            self._depth -= 1

    method.__name__ = name
    return method


class ProfilingOps:
    """A backend with a wall-clock timer around every op (CPU ops are synchronous, so the time is
    the op's own). Only calls made while `active` are counted, and only the outermost one."""

    lm_head_names = frozenset({"output.weight", "token_embd.weight"})

    def __init__(self, inner: Ops) -> None:
        self.inner = inner
        self.name, self.notices = inner.name, inner.notices
        self.active = False
        self._depth = 0
        self.ns: dict[str, int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:  # weights, scratch and rope tables: the backend's
        return getattr(self.inner, name)

    def bind(self, op: str, args: list, out: Any, scratch: list) -> Callable[[], Any] | None:
        """The backend's bound call for a node, with the same timer around it."""
        inner = getattr(self.inner, "bind", None)
        f = inner(op, args, out, scratch) if inner else None
        if f is None or op not in OP_CATEGORY:
            return f
        cat = OP_CATEGORY[op]
        if op == "linear" and getattr(args[1], "name", "") in self.lm_head_names:
            cat = "lm_head"

        def timed() -> None:
            if not self.active:
                return f()
            t0 = time.perf_counter_ns()
            f()
            self.ns[cat] += time.perf_counter_ns() - t0

        return timed

    def reset(self) -> None:
        self.ns.clear()


for _name, _cat in OP_CATEGORY.items():
    setattr(ProfilingOps, _name, _timed(_name, _cat))

__all__ = ["OP_CATEGORY", "CATEGORIES", "CATEGORY_TITLES", "ProfilingOps"]
