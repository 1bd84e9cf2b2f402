"""Every command-line value checked before anything is loaded: one place, one message shape.

A bad value costs one line (`-b 0: invalid value for n_batch: must be at least 1`) and exit 1,
never a model load, an allocation or a traceback first. The checks that only need Python run
before the engine is imported, so a typo answers in well under a second; the few that need the
engine's own tables (KV cache types, backends, LLAMA_MAX_SEQ) import them lazily and are called
last, still before the model loads. Typer's type errors (`-c abc`) stay Typer's.

Sentinels are llama.cpp's where it has them: `-c 0` = the model's context, `-n -1` = no limit,
`-t -1` = every core, `-ub 0` = n_batch, `-s -1` = a random seed, `--keep -1` = the whole prompt, `--repeat-last-n
-1` = the whole context, server `-np -1` = auto. Where llama.cpp takes any value and quietly
treats it as something else (`-t 0`, `--temp nan`, `-np -3`), ubatch refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ubatch.engine.errors import UbatchError

INT32_MAX = 2**31 - 1  # llama.cpp reads integer flags with std::stoi
UINT32_MAX = 2**32 - 1  # seeds are uint32 (LLAMA_DEFAULT_SEED = UINT32_MAX means random)
GGML_MAX_N_THREADS = 512
DEFAULT_KV_TYPE = "f16"  # -ctk and -ctv's default in every llama.cpp tool


class FlagError(UbatchError):
    """A command-line value outside what its flag allows: names the flag, the value, the range."""


def _shown(v: object) -> str:
    return repr(v) if isinstance(v, str | float) else str(v)


def invalid(flag: str, value: object, name: str, allowed: str) -> FlagError:
    """The one message shape: `-np 0: invalid value for n_parallel: use -1 (auto) or ...`."""
    return FlagError(f"{flag} {_shown(value)}: invalid value for {name}: {allowed}")


def _span(lo: int, hi: int) -> str:
    return f"at least {lo}" if hi >= INT32_MAX else f"between {lo} and {hi}"


def in_range(
    flag: str, v: int, name: str, lo: int, hi: int = INT32_MAX, sentinel: tuple[int, str] | None = None
) -> int:
    """An integer in lo..hi, or the flag's sentinel (value, meaning) such as (-1, 'unlimited')."""
    if lo <= v <= hi or (sentinel is not None and v == sentinel[0]):
        return v
    allowed = f"must be {_span(lo, hi)}"
    if sentinel is not None:
        allowed = f"use {sentinel[0]} ({sentinel[1]}) or a value {'of ' if hi >= INT32_MAX else ''}{_span(lo, hi)}"
        if v < 0 <= sentinel[0]:
            allowed = f"cannot be negative; {allowed}"
    raise invalid(flag, v, name, allowed)


def at_least(flag: str, v: int, name: str, lo: int, sentinel: tuple[int, str] | None = None) -> int:
    return in_range(flag, v, name, lo, INT32_MAX, sentinel)


def positive(flag: str, v: int, name: str) -> int:
    return in_range(flag, v, name, 1)


def finite(flag: str, v: float, name: str, lo: float = -math.inf, hi: float = math.inf, open_lo: bool = False) -> float:
    """A finite float in [lo, hi] ((lo, inf) with open_lo): NaN and inf never reach a sampler."""
    if not math.isfinite(v):
        raise invalid(flag, v, name, "must be a finite number")
    if v < lo or v > hi or (open_lo and v == lo):
        if hi < math.inf:
            raise invalid(flag, v, name, f"must be between {lo:g} and {hi:g}")
        raise invalid(flag, v, name, f"must be {'above' if open_lo else 'at least'} {lo:g}")
    return v


def fraction(flag: str, v: float, name: str) -> float:
    return finite(flag, v, name, 0.0, 1.0)


def choice(flag: str, v: str, name: str, allowed: Iterable[str]) -> str:
    options = list(allowed)
    if v not in options:
        raise invalid(flag, v, name, f"use one of {', '.join(options)}")
    return v


# -- the flags several commands share -------------------------------------------------------------


def context_flags(ctx_size: int, batch_size: int, ubatch_size: int, threads: int | None = None) -> None:
    """-c -b -ub (-t): llama.cpp's context parameters. `-ub 0` is llama_context's "the same as
    n_batch" (`n_ubatch ? n_ubatch : n_batch`); the engine resolves it (`engine.params.derive`)."""
    at_least("-c", ctx_size, "n_ctx", 1, sentinel=(0, "from the model"))
    positive("-b", batch_size, "n_batch")
    at_least("-ub", ubatch_size, "n_ubatch", 1, sentinel=(0, "n_batch"))
    if threads is not None:
        in_range("-t", threads, "n_threads", 1, GGML_MAX_N_THREADS, sentinel=(-1, "all cores"))


def generation_flags(n_predict: int, keep: int | None = None) -> None:
    at_least("-n", n_predict, "n_predict", 0, sentinel=(-1, "unlimited"))
    if keep is not None:
        at_least("--keep", keep, "n_keep", 0, sentinel=(-1, "all of the prompt"))


def sampling_flags(
    temp: float, top_k: int, top_p: float, min_p: float, seed: int, repeat_penalty: float, repeat_last_n: int
) -> None:
    """The sampler chain's flags; a temperature <= 0 is greedy, as in llama.cpp."""
    finite("--temp", temp, "temp")
    at_least("--top-k", top_k, "top_k", 0)  # 0 = disabled
    fraction("--top-p", top_p, "top_p")
    fraction("--min-p", min_p, "min_p")
    in_range("-s", seed, "seed", 0, UINT32_MAX, sentinel=(-1, "random"))
    finite("--repeat-penalty", repeat_penalty, "penalty_repeat", 0.0, open_lo=True)  # 1 = disabled
    at_least("--repeat-last-n", repeat_last_n, "penalty_last_n", 0, sentinel=(-1, "the whole context"))


# -- checks against the engine's own tables (these import it: call them last) --------------------
# A default value is valid in any table, so it is passed without loading one: a command line
# without these flags reaches the model load (where torch loads anyway) with nothing imported.


def n_parallel(v: int, auto: bool = False, flag: str = "-np") -> int:
    """-np (batched-bench: each -npl): 1..LLAMA_MAX_SEQ sequences; the server also takes -1 (auto)."""
    sentinel = (-1, "auto") if auto else None
    at_least(flag, v, "n_parallel", 1, sentinel)  # before the engine import: `-np 0` answers at once
    if v == 1 or (sentinel is not None and v == sentinel[0]):
        return v  # within any table: the defaults never load it
    from ubatch.engine.params import LLAMA_MAX_SEQ

    return in_range(flag, v, "n_parallel", 1, LLAMA_MAX_SEQ, sentinel)


def kv_types(ctk: str, ctv: str) -> None:
    if ctk == ctv == DEFAULT_KV_TYPE:
        return  # valid by definition: the table (it loads torch) is read for another type only
    from ubatch.engine.params import KV_TYPES

    choice("-ctk", ctk, "the KV cache type of K", KV_TYPES)
    choice("-ctv", ctv, "the KV cache type of V", KV_TYPES)


def backend(name: str) -> str:
    if name == "auto":
        return name  # always a backend: the table (it loads torch) is read for a named one only
    from ubatch.kernels.backends import names

    if name not in names():
        raise FlagError(f"--backend {_shown(name)}: unknown backend {name!r}; use one of {', '.join(names())}")
    return name
