"""Runs of bound C calls fused into one call of `ub_run` (kernels/cpu/csrc/program.c).

A decode step of the default model is about 400 small kernels; through ctypes each costs a
microsecond or more of argument conversion before any work starts. `bind_node` returns each call
as a `CCall` (op, ctypes function, arguments); `fuse` turns every run of consecutive CCalls in a
bound graph into one program (a flat int64 array the C side walks), so the step pays one ctypes
call per run. A CCall still runs alone when called, which is how the unfused paths use it.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence

from torch import Tensor

from ubatch.kernels.ops import Step

# op -> (code, arity, positions of float arguments); the codes and arities are program.c's
PROGRAM_OPS: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "gemv": (0, 12, ()),
    "get_rows": (1, 8, ()),
    "rms_norm": (2, 9, (5,)),
    "rope": (3, 10, ()),
    "glu": (4, 6, ()),
    "add": (5, 5, ()),
    "scale": (6, 5, (1,)),
    "rows": (7, 5, ()),
    "kv_store": (8, 6, ()),
    "attention": (9, 18, (14, 15)),
    "gemm": (10, 12, ()),
    "gemm_amx": (11, 12, ()),
    "add_bias": (12, 6, ()),
    "softcap": (13, 6, (1,)),
    "mul_mat_id": (14, 18, ()),
    "moe_topk": (15, 9, ()),
    "moe_weights": (16, 9, (7,)),
    "moe_sum": (17, 7, ()),
    "lora": (18, 17, ()),
}


class CCall:
    """One kernel call with every argument bound."""

    __slots__ = ("op", "fn", "args", "keep")

    def __init__(self, op: str, fn: Callable[..., object], args: tuple[int | float, ...]) -> None:
        self.op, self.fn, self.args = op, fn, args
        self.keep: Tensor | None = None  # what a pointer among the arguments points into, if the call owns it

    def __call__(self) -> object:
        return self.fn(*self.args)

    def words(self) -> list[int]:
        code, arity, floats = PROGRAM_OPS[self.op]
        assert len(self.args) == arity, (self.op, len(self.args))
        out = [code]
        for i, v in enumerate(self.args):
            out.append(struct.unpack("<I", struct.pack("<f", v))[0] if i in floats else int(v))
        return out


class Program:
    """Consecutive CCalls as one `ub_run` call; the array lives as long as the program."""

    __slots__ = ("calls", "_buf", "_run", "_n")

    def __init__(self, lib: ctypes.CDLL, calls: Sequence[CCall]) -> None:
        self.calls = list(calls)
        words = [w for c in self.calls for w in c.words()]
        self._buf = (ctypes.c_int64 * len(words))(*words)
        self._run, self._n = lib.ub_run, len(self.calls)

    def __call__(self) -> None:
        done = self._run(self._buf, self._n)
        if done != self._n:
            raise RuntimeError(f"ub_run stopped at node {done} ({self.calls[done].op})")


def _library_of(call: CCall, libs: Sequence[ctypes.CDLL]) -> ctypes.CDLL:
    """The library whose function a call runs (ctypes keeps one function object per symbol and
    library, so identity tells them apart); a program must run in that library's `ub_run`."""
    name = getattr(call.fn, "__name__", "")
    for lib in libs:
        if getattr(lib, name, None) is call.fn:
            return lib
    return libs[0]


def fuse(libs: ctypes.CDLL | Sequence[ctypes.CDLL], steps: Sequence[Step]) -> list[Step]:
    """The steps with every run of two or more CCalls of one library replaced by one Program
    (the default CPU backend may take decode's and prefill's kernels from two builds, and a
    program's op codes name the functions of the library that runs it)."""
    libs = [libs] if isinstance(libs, ctypes.CDLL) else list(libs)
    out: list[Step] = []
    run: list[CCall] = []
    run_lib: ctypes.CDLL | None = None

    def flush() -> None:
        if run_lib is not None:
            out.extend([Program(run_lib, run)] if len(run) > 1 else run)
        run.clear()

    for s in steps:
        if isinstance(s, CCall):
            lib = libs[0] if len(libs) == 1 else _library_of(s, libs)
            if lib is not run_lib:
                flush()
                run_lib = lib
            run.append(s)
        else:
            flush()
            out.append(s)
    flush()
    return out


def check_arities(lib: ctypes.CDLL) -> None:
    """The table above against the library's (a stale library or table fails loudly, once)."""
    for op, (code, arity, _) in PROGRAM_OPS.items():
        if lib.ub_program_arity(code) != arity:
            raise OSError(f"kernel program table: {op} has arity {lib.ub_program_arity(code)} in C, {arity} here")
