"""llama-bench's parameter lists, turned into the test instances a run will time.

Everything the user types (comma lists, ranges `first-last`, `first-last+step`,
`first-last*mult`, `-pg pp,tg` pairs) is parsed and checked here, before a model is loaded, so a
typo costs a one-line error rather than a half-finished run. `expand` then crosses the lists in
llama-bench's order. It serves `ubatch bench` alone, so it sits in cli/bench/, above the engine.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ubatch.cli.context_flags import context_params
from ubatch.engine.errors import UbatchError

if TYPE_CHECKING:
    from ubatch.engine.params import ContextParams

# the engine's tables (KV_TYPES, ContextParams) pull in torch: imported where used, so a typo in a
# list is answered before torch loads
INT32_MAX = 2**31 - 1  # llama-bench reads list items with std::stoi
MAX_LIST = 4096  # values one flag may expand to: `-p 1-2000000000` is a typo, not 2e9 tests


class BenchError(UbatchError):
    """A bench request that cannot run (bad list syntax, impossible test): one line for the user."""


# -- parameter lists ------------------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+)(?:([+*])(\d+))?)?$")


def parse_int_range(text: str, flag: str = "value") -> list[int]:
    """llama-bench's parse_int_range: `N`, `first-last`, `first-last+step`, `first-last*mult`,
    comma separated. Unlike llama-bench an empty range (first > last) is an error, not zero tests."""
    out: list[int] = []
    for item in str(text).split(","):
        item = item.strip()
        m = _RANGE.match(item)
        if not m:
            raise BenchError(
                f"{flag}: invalid value {item!r}: use N, first-last, first-last+step or first-last*mult (comma separated)"
            )
        first = int(m[1])
        last = int(m[2]) if m[2] is not None else first
        if last > INT32_MAX:
            raise BenchError(f"{flag} {item!r}: invalid value: must be at most {INT32_MAX}")
        op, step = m[3] or "+", int(m[4]) if m[4] is not None else 1
        if first > last:
            raise BenchError(
                f"{flag}: range {item!r} is empty (first > last); write it ascending, e.g. {last}-{first}*2"
            )
        i = first
        while i <= last:
            out.append(i)
            if len(out) > MAX_LIST:
                raise BenchError(f"{flag} {text!r}: more than {MAX_LIST} values; use a larger step or a *mult range")
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise BenchError(
                    f"{flag}: range {item!r} does not advance (step >= 1, mult >= 2, and a multiplied range cannot start at 0)"
                )
            i = nxt
    return out


def int_list(values: Sequence[str] | None, default: Sequence[int], flag: str, lo: int = 0, name: str = "") -> list[int]:
    """Repeated flags and comma lists concatenate; a user-given list replaces the default. Every
    value the user gives must be at least `lo` (the default may hold a sentinel, e.g. -t 0 = all)."""
    if not values:
        return list(default)
    out = [v for text in values for v in parse_int_range(text, flag)]
    for v in out:
        if v < lo:
            raise BenchError(f"{flag} {v}: invalid value for {name or flag}: must be at least {lo}")
    return out


def str_list(
    values: Sequence[str] | None, default: Sequence[str], flag: str, allowed: Iterable[str] | None = None
) -> list[str]:
    if not values:
        return list(default)
    out = [s.strip() for text in values for s in str(text).split(",")]
    ok = set(allowed) if allowed is not None else None
    for s in out:
        if not s or (ok is not None and s not in ok):
            raise BenchError(f"{flag}: unknown value {s!r}; use one of {', '.join(sorted(ok or []))}")
    return out


def pair_list(values: Sequence[str] | None, flag: str = "-pg") -> list[tuple[int, int]]:
    """-pg pp,tg (repeat the flag for several pairs)."""
    out = []
    for text in values or []:
        parts = str(text).split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise BenchError(f"{flag}: expected a pair pp,tg (e.g. 512,128), got {text!r}")
        out.append((int(parts[0]), int(parts[1])))
    return out


# -- tests ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class BenchParams:
    """llama-bench's command-line parameters (lists are crossed), ubatch's defaults = llama-bench's."""

    models: list[Path]
    n_prompt: list[int] = field(default_factory=lambda: [512])
    n_gen: list[int] = field(default_factory=lambda: [128])
    n_pg: list[tuple[int, int]] = field(default_factory=list)
    n_depth: list[int] = field(default_factory=lambda: [0])
    n_batch: list[int] = field(default_factory=lambda: [2048])
    n_ubatch: list[int] = field(default_factory=lambda: [512])
    type_k: list[str] = field(default_factory=lambda: ["f16"])
    type_v: list[str] = field(default_factory=lambda: ["f16"])
    n_outputs_max: list[int] = field(default_factory=lambda: [0])  # 0 = n_batch, as llama-bench
    n_threads: list[int] = field(default_factory=lambda: [0])  # 0 = every core torch may use
    backend: str = "auto"  # op backend (kernels.backends)
    reps: int = 5
    warmup: bool = True
    profile: bool = False
    delay: float = 0.0
    seed: int = 1


@dataclass(frozen=True, slots=True)
class BenchTest:
    """One test instance: a pp, tg or pp+tg run under one context configuration."""

    model: Path
    n_prompt: int
    n_gen: int
    n_depth: int
    n_batch: int
    n_ubatch: int
    type_k: str
    type_v: str
    n_outputs_max: int
    n_threads: int
    backend: str = "auto"

    @property
    def name(self) -> str:
        """llama-bench's test column: pp512, tg128, pp512+tg128, with ' @ d4096' for depth."""
        if self.n_prompt and self.n_gen:
            s = f"pp{self.n_prompt}+tg{self.n_gen}"
        elif self.n_prompt:
            s = f"pp{self.n_prompt}"
        else:
            s = f"tg{self.n_gen}"
        return s + (f" @ d{self.n_depth}" if self.n_depth else "")

    @property
    def n_ctx(self) -> int:
        """llama-bench sizes the context per test: n_prompt + n_gen + n_depth (padded later)."""
        return self.n_prompt + self.n_gen + self.n_depth

    def context_params(self) -> ContextParams:
        return context_params(
            ctx_size=self.n_ctx,
            batch_size=self.n_batch,
            ubatch_size=self.n_ubatch,
            ctk=self.type_k,
            ctv=self.type_v,
            threads=self.n_threads,
            backend=self.backend,
            n_outputs_max=self.n_outputs_max,
        )

    @property
    def context_key(self) -> tuple:
        return (
            self.model,
            self.n_ctx,
            self.n_batch,
            self.n_ubatch,
            self.n_threads,
            self.type_k,
            self.type_v,
            self.n_outputs_max,
            self.backend,
        )


def expand(p: BenchParams) -> list[BenchTest]:
    """get_cmd_params_instances: the product model x n_batch x n_ubatch x type_k x type_v x
    (n_outputs_max) x threads x depth; inside each, one test per -p (0 skipped), then per -n
    (0 skipped), then per -pg pair."""
    tests = []
    axes = (p.models, p.n_batch, p.n_ubatch, p.type_k, p.type_v, p.n_outputs_max, p.n_threads, p.n_depth)
    for m, nb, nub, tk, tv, nom, nt, d in itertools.product(*axes):
        base = BenchTest(m, 0, 0, d, nb, nub, tk, tv, nom, nt, p.backend)
        tests += [replace(base, n_prompt=x) for x in p.n_prompt if x]
        tests += [replace(base, n_gen=x) for x in p.n_gen if x]
        tests += [replace(base, n_prompt=a, n_gen=b) for a, b in p.n_pg if a or b]
    return tests


def check_params(p: BenchParams) -> None:
    """What a run needs of its parameters, whoever built them (the CLI has already said which
    flag was wrong; a caller of run_bench gets the same one-line errors)."""
    from ubatch.engine.kv.cache import KV_TYPES

    if not 1 <= p.reps <= INT32_MAX:
        raise BenchError(f"-r {p.reps}: invalid value for reps: must be at least 1")
    if not math.isfinite(p.delay) or p.delay < 0:
        raise BenchError(f"--delay {p.delay!r}: invalid value for delay: must be a finite number of seconds >= 0")
    lists = (("-b", p.n_batch, 1), ("-ub", p.n_ubatch, 0), ("-nom", p.n_outputs_max, 0), ("-t", p.n_threads, 0))
    for flag, vals, lo in lists:
        for v in vals:
            if not lo <= v <= INT32_MAX:
                raise BenchError(f"{flag} {v}: invalid value: must be at least {lo}")
    for t in (*p.type_k, *p.type_v):
        if t not in KV_TYPES:
            raise BenchError(f"unsupported KV cache type {t!r}; use one of {', '.join(KV_TYPES)}")


def check_tests(tests: list[BenchTest], n_ctx_train: dict[Path, int]) -> None:
    """Refuse, before anything runs, a test whose context (depth + prompt + generation) is beyond
    what the model was trained for."""
    if not tests:
        raise BenchError("nothing to run: every -p, -n and -pg value is 0")
    for t in tests:
        limit = n_ctx_train[t.model]
        if t.n_ctx > limit:
            raise BenchError(
                f"test {t.name} needs a context of {t.n_ctx} tokens (depth {t.n_depth} + "
                f"prompt {t.n_prompt} + generation {t.n_gen}), beyond the model's "
                f"training context of {limit}; lower -d, -p or -n"
            )


__all__ = [
    "BenchError",
    "BenchParams",
    "BenchTest",
    "parse_int_range",
    "int_list",
    "str_list",
    "pair_list",
    "expand",
    "check_params",
    "check_tests",
]
