"""llama-bench and llama-batched-bench as data: test expansion, runs, results, op profiles.

`expand` turns llama-bench's parameter lists (comma lists and ranges `first-last`,
`first-last+step`, `first-last*mult`) into the Cartesian product of test instances in
llama-bench's order; `run_bench` runs them (one model load per model, one context per distinct
context configuration, a warm-up, then `reps` timed repetitions) and returns `BenchResult`
records carrying llama-bench's fields plus what llama-bench cannot tell: the compute buffer
reserved for the context, the largest graph that actually ran, the KV cache, the tensors that
make up the buffer at its peak and, with `profile=True`, where the time went op by op.
`run_batched_bench` is llama-batched-bench's continuous-batching throughput harness.

Nothing here prints; progress is reported through a callback with `BenchEvent`s.
"""

from __future__ import annotations

import datetime as _dt
import functools
import re
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..kernels.cpu_build import cpu_model
from ..kernels.ops import Ops
from .batch import Batch
from .context import Context, make_backend
from .errors import UbatchError
from .forward import GraphShape
from .graph import Graph
from .kv_cache import KV_TYPES
from .model import Model
from .params import ContextParams, derive

MiB = 1024 * 1024


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
            raise BenchError(f"{flag}: invalid value {item!r}: use N, first-last, first-last+step "
                             f"or first-last*mult (comma separated)")
        first = int(m[1])
        last = int(m[2]) if m[2] is not None else first
        op, step = m[3] or "+", int(m[4]) if m[4] is not None else 1
        if first > last:
            raise BenchError(f"{flag}: range {item!r} is empty (first > last); write it ascending, "
                             f"e.g. {last}-{first}*2")
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise BenchError(f"{flag}: range {item!r} does not advance (step >= 1, mult >= 2, "
                                 f"and a multiplied range cannot start at 0)")
            i = nxt
    return out


def int_list(values: Sequence[str] | None, default: Sequence[int], flag: str) -> list[int]:
    """Repeated flags and comma lists concatenate; a user-given list replaces the default."""
    if not values:
        return list(default)
    return [v for text in values for v in parse_int_range(text, flag)]


def str_list(values: Sequence[str] | None, default: Sequence[str], flag: str,
             allowed: Iterable[str] | None = None) -> list[str]:
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
        return ContextParams(n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                             n_threads=self.n_threads, type_k=self.type_k, type_v=self.type_v,
                             n_outputs_max=self.n_outputs_max, backend=self.backend)

    @property
    def context_key(self) -> tuple:
        return (self.model, self.n_ctx, self.n_batch, self.n_ubatch, self.n_threads, self.type_k,
                self.type_v, self.n_outputs_max, self.backend)


def expand(p: BenchParams) -> list[BenchTest]:
    """get_cmd_params_instances: the product model x n_batch x n_ubatch x type_k x type_v x
    (n_outputs_max) x threads x depth; inside each, one test per -p (0 skipped), then per -n
    (0 skipped), then per -pg pair."""
    tests = []
    for m in p.models:
        for nb in p.n_batch:
            for nub in p.n_ubatch:
                for tk in p.type_k:
                    for tv in p.type_v:
                        for nom in p.n_outputs_max:
                            for nt in p.n_threads:
                                for d in p.n_depth:
                                    base = dict(model=m, n_depth=d, n_batch=nb, n_ubatch=nub, type_k=tk,
                                                type_v=tv, n_outputs_max=nom, n_threads=nt,
                                                backend=p.backend)
                                    tests += [BenchTest(n_prompt=x, n_gen=0, **base) for x in p.n_prompt if x]
                                    tests += [BenchTest(n_prompt=0, n_gen=x, **base) for x in p.n_gen if x]
                                    tests += [BenchTest(n_prompt=a, n_gen=b, **base) for a, b in p.n_pg
                                              if a or b]
    return tests


def check_params(p: BenchParams) -> None:
    if p.reps < 1:
        raise BenchError(f"-r {p.reps}: at least one repetition is needed")
    for name, vals in (("-b", p.n_batch), ("-ub", p.n_ubatch)):
        if any(v <= 0 for v in vals):
            raise BenchError(f"{name}: values must be positive")
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
            raise BenchError(f"test {t.name} needs a context of {t.n_ctx} tokens (depth {t.n_depth} + "
                             f"prompt {t.n_prompt} + generation {t.n_gen}), beyond the model's "
                             f"training context of {limit}; lower -d, -p or -n")


# -- results --------------------------------------------------------------------------------------

@dataclass(slots=True)
class TensorShare:
    name: str
    shape: tuple[int, ...]
    mib: float


@dataclass(slots=True)
class BenchResult:
    """llama-bench's record (the fields its csv/json printers write) plus ubatch's columns."""

    build_commit: str
    build_number: int
    cpu_info: str
    gpu_info: str
    backends: str
    model_filename: str
    model_type: str
    model_size: int
    model_n_params: int
    n_batch: int  # as requested (llama-bench reports the request)
    n_ubatch: int
    n_threads: int
    type_k: str
    type_v: str
    n_gpu_layers: int
    flash_attn: int
    n_prompt: int
    n_gen: int
    n_depth: int
    test_time: str
    avg_ns: int
    stddev_ns: int
    avg_ts: float
    stddev_ts: float
    samples_ns: list[int]
    samples_ts: list[float]
    # ubatch's columns
    test: str
    n_ctx: int  # effective (padded to 256)
    n_batch_eff: int  # after llama.cpp's clamps: min(n_ctx_requested, b)
    n_ubatch_eff: int  # min(n_batch_eff, ub)
    n_outputs_max: int  # effective
    compute_buffer_mib: float  # the reserved workspace (llama.cpp's "compute buffer size")
    used_buffer_mib: float  # the largest graph that actually ran in this test
    kv_mib: float
    n_ubatches: int  # forward passes per repetition
    buffer_top: list[TensorShare] = field(default_factory=list)  # tensors alive at the reserved peak
    used_top: list[TensorShare] = field(default_factory=list)  # ... at the peak of the largest graph run
    profile_ms: dict[str, float] = field(default_factory=dict)  # per repetition, by op category

    def to_dict(self, samples: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not samples:
            for k in ("samples_ns", "samples_ts", "buffer_top", "used_top", "profile_ms"):
                d.pop(k)
        return d


# llama_model_ftype_name for the file types a GGUF header names
FTYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K - Medium", 11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K",
    19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw", 21: "Q2_K - Small",
    22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw",
    28: "IQ2_S - 2.5 bpw", 29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw",
    32: "BF16", 36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary", 38: "MXFP4 MoE",
}


def model_description(model: Model) -> str:
    """llama_model_desc: '<arch> <size> <file type>', e.g. 'gemma3 270M Q4_K - Medium'."""
    md = model.gguf.metadata
    size = md.get("general.size_label")
    if not size:
        n = model.n_params
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
    ft = md.get("general.file_type")
    if ft is not None:
        ftype = FTYPE_NAMES.get(int(ft), f"ftype {int(ft)}")
    else:  # llama.cpp guesses from the most common matrix type
        from gguf import GGMLQuantizationType as T

        counts: dict[int, int] = defaultdict(int)
        for w in model.matrices():
            counts[w.ggml_type] += 1
        ftype = T(max(counts, key=lambda k: counts[k])).name + " (guessed)"
    return f"{model.hparams.arch} {size} {ftype}"


@functools.lru_cache(maxsize=1)
def build_info() -> tuple[str, int]:
    """(build_commit, build_number): ubatch's version, with the git commit when run from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("ubatch")
    except PackageNotFoundError:
        v = "unknown"
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                           capture_output=True, text=True, timeout=5)
        if r.returncode == 0 and r.stdout.strip():
            v += "+g" + r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return v, 0


@functools.lru_cache(maxsize=1)
def cpu_info() -> str:
    return cpu_model()


# -- profiling ------------------------------------------------------------------------------------

# op method -> category; `linear` with the output matrix is split out as "lm_head"
OP_CATEGORY = {
    "linear": "matmul", "attention": "attention", "kv_chunk": "attention",
    "rms_norm": "norm", "rope": "rope", "rope_cache": "rope",
    "scale": "elementwise", "add": "elementwise", "glu": "elementwise", "softcap": "elementwise",
    "get_rows": "rows", "rows": "rows", "kv_store": "kv_write",
}
CATEGORIES = ("matmul", "lm_head", "attention", "norm", "rope", "elementwise", "kv_write", "rows",
              "overhead")
CATEGORY_TITLES = {
    "matmul": "matmul (layers)", "lm_head": "matmul (output)", "attention": "attention",
    "norm": "norms", "rope": "rope", "elementwise": "act/add/scale", "kv_write": "KV writes",
    "rows": "embd/rows", "overhead": "Python/graph",
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


class BenchContext(Context):
    """A Context that remembers the largest graph it actually ran (vs the one it reserved for)."""

    def __init__(self, model: Model, params: ContextParams, ops: Ops | None = None) -> None:
        self.largest: Graph | None = None
        super().__init__(model, params, ops=ops)

    def graph_for(self, shape: GraphShape) -> Graph:
        g = super().graph_for(shape)
        if self.largest is None or g.size > self.largest.size:
            self.largest = g
        return g


def _shares(peak: list[tuple[str, tuple[int, ...], int]], n: int = 8) -> list[TensorShare]:
    return [TensorShare(name, tuple(shape), b / MiB) for name, shape, b in peak[:n]]


# -- running --------------------------------------------------------------------------------------

@dataclass(slots=True)
class BenchEvent:
    """Progress: kind is 'load' (a model), 'context' (a new context), 'warmup', 'rep', 'done'
    (a test finished, `result` set) or 'note' (something the user should know, `text`)."""

    kind: str
    test_index: int = 0  # 1-based
    n_tests: int = 0
    rep: int = 0  # 1-based
    n_reps: int = 0
    test: BenchTest | None = None
    result: BenchResult | None = None
    text: str = ""


def _random_tokens(rng: np.random.Generator, n_vocab: int, n: int) -> list[int]:
    return rng.integers(0, n_vocab, size=n).tolist()


def run_prompt(ctx: Context, n_prompt: int, rng: np.random.Generator) -> None:
    """test_prompt: random tokens (BOS first if the vocab adds one) in n_batch chunks, each chunk
    one decode with only its last token as an output, appended to sequence 0."""
    v, n_vocab, nb = ctx.model.vocab, ctx.model.hparams.n_vocab, ctx.cparams.n_batch
    pos = ctx.memory.seq_pos_max(0) + 1
    done = 0
    while done < n_prompt:
        n = min(n_prompt - done, nb)
        toks = _random_tokens(rng, n_vocab, n)
        if done == 0 and v.add_bos:
            toks[0] = v.bos
        ctx.decode(Batch.from_tokens(toks, pos + done))
        done += n


def run_gen(ctx: Context, n_gen: int, rng: np.random.Generator) -> None:
    """test_gen: n_gen single-token decodes (BOS first if the vocab adds one, then random)."""
    v, n_vocab = ctx.model.vocab, ctx.model.hparams.n_vocab
    tok = v.bos if v.add_bos else int(rng.integers(0, n_vocab))
    pos = ctx.memory.seq_pos_max(0) + 1
    for i in range(n_gen):
        ctx.decode(Batch.from_tokens([tok], pos + i))
        tok = int(rng.integers(0, n_vocab))


def _stats(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n-1; 0 for one sample), as llama-bench."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def run_bench(p: BenchParams, on_event: Callable[[BenchEvent], None] | None = None,
              models: dict[Path, Model] | None = None) -> list[BenchResult]:
    """Run every test of `expand(p)`; `models` may hold already-loaded models by path."""
    emit = on_event or (lambda e: None)
    check_params(p)
    tests = expand(p)
    models = dict(models or {})
    for path in dict.fromkeys(t.model for t in tests):
        if path not in models:
            emit(BenchEvent("load", text=str(path)))
            models[path] = Model.load(path)
    check_tests(tests, {k: m.hparams.n_ctx_train for k, m in models.items()})
    warned: set[tuple[int, int]] = set()
    for t in tests:
        if t.n_ubatch > t.n_batch and (t.n_batch, t.n_ubatch) not in warned:
            warned.add((t.n_batch, t.n_ubatch))
            emit(BenchEvent("note", text=f"-ub {t.n_ubatch} > -b {t.n_batch}: n_ubatch is clamped to "
                                         f"{t.n_batch} (llama.cpp: n_ubatch = min(n_batch, ub))"))
    commit, number = build_info()
    results: list[BenchResult] = []
    ctx: BenchContext | None = None
    ops: ProfilingOps | None = None
    ctx_key: tuple | None = None
    for ti, t in enumerate(tests, 1):
        model = models[t.model]
        if ctx is None or ctx_key != t.context_key:
            ctx = ops = None  # free the previous context's KV cache and workspace first
            cparams = t.context_params()
            ops = ProfilingOps(make_backend(t.backend, derive(cparams, model.hparams).n_threads)) \
                if p.profile else None
            ctx = BenchContext(model, cparams, ops=ops)
            ctx_key = t.context_key
            emit(BenchEvent("context", ti, len(tests), test=t))
        torch.set_num_threads(ctx.cparams.n_threads)
        ctx.largest = None  # per test, even when the context carries over from the last one
        started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        rng = np.random.default_rng(p.seed + ti)
        if p.warmup:
            emit(BenchEvent("warmup", ti, len(tests), 0, p.reps, t))
            ctx.memory.clear()
            if t.n_prompt:
                run_prompt(ctx, t.n_prompt, rng)
            if t.n_gen:
                run_gen(ctx, 1, rng)
        if ops is not None:
            ops.reset()
        samples: list[int] = []
        n_ub = 0
        for r in range(1, p.reps + 1):
            emit(BenchEvent("rep", ti, len(tests), r, p.reps, t))
            ctx.memory.clear()
            if t.n_depth:
                run_prompt(ctx, t.n_depth, rng)  # not timed
            n_ub0 = ctx.perf.n_ubatch
            if ops is not None:
                ops.active = True
            t0 = time.perf_counter_ns()
            if t.n_prompt:
                run_prompt(ctx, t.n_prompt, rng)
            if t.n_gen:
                run_gen(ctx, t.n_gen, rng)
            dt = time.perf_counter_ns() - t0
            if ops is not None:
                ops.active = False
            samples.append(dt)
            n_ub = ctx.perf.n_ubatch - n_ub0
        n_tok = t.n_prompt + t.n_gen
        avg_ns, sd_ns = _stats([float(s) for s in samples])
        ts = [1e9 * n_tok / s for s in samples]
        avg_ts, sd_ts = _stats(ts)
        profile: dict[str, float] = {}
        if ops is not None:
            profile = {c: ops.ns.get(c, 0) / 1e6 / p.reps for c in CATEGORIES if c != "overhead"}
            profile["overhead"] = max(0.0, avg_ns / 1e6 - sum(profile.values()))
        cp = ctx.cparams
        kv = sum(i.k_bytes + i.v_bytes for i in (c.info() for c in ctx.memory.caches))
        used = ctx.largest
        res = BenchResult(
            build_commit=commit, build_number=number, cpu_info=cpu_info(), gpu_info="", backends=f"CPU ({ctx.ops.name})",
            model_filename=str(t.model), model_type=model_description(model),
            model_size=model.size_bytes, model_n_params=model.n_params,
            n_batch=t.n_batch, n_ubatch=t.n_ubatch, n_threads=cp.n_threads, type_k=t.type_k,
            type_v=t.type_v, n_gpu_layers=0, flash_attn=1, n_prompt=t.n_prompt, n_gen=t.n_gen,
            n_depth=t.n_depth,
            test_time=started,
            avg_ns=int(round(avg_ns)), stddev_ns=int(round(sd_ns)), avg_ts=avg_ts, stddev_ts=sd_ts,
            samples_ns=samples, samples_ts=ts, test=t.name, n_ctx=cp.n_ctx, n_batch_eff=cp.n_batch,
            n_ubatch_eff=cp.n_ubatch, n_outputs_max=cp.n_outputs_max,
            compute_buffer_mib=ctx.reservation.bytes / MiB,
            used_buffer_mib=(used.size if used else 0) / MiB, kv_mib=kv / MiB, n_ubatches=n_ub,
            buffer_top=_shares(ctx.reservation.peak),
            used_top=_shares(used.describe_peak()) if used else [],
            profile_ms=profile,
        )
        results.append(res)
        emit(BenchEvent("done", ti, len(tests), p.reps, p.reps, t, res))
        if p.delay > 0 and ti < len(tests):
            time.sleep(p.delay)
    return results


# -- llama-batched-bench ---------------------------------------------------------------------------

@dataclass(slots=True)
class BatchedParams:
    """llama-batched-bench's parameters (its defaults: -npp 128,256,512 -ntg 128,256
    -npl 1,2,4,8,16,32; -c 0 = the training context)."""

    model: Path
    n_ctx: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 0
    type_k: str = "f16"
    type_v: str = "f16"
    n_pp: list[int] = field(default_factory=lambda: [128, 256, 512])
    n_tg: list[int] = field(default_factory=lambda: [128, 256])
    n_pl: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    pps: bool = False  # the prompt is shared by all sequences
    tgs: bool = False  # generate the sequences one after another
    kvu: bool = False  # one unified KV stream
    backend: str = "auto"
    seed: int = 1


@dataclass(slots=True)
class BatchedHeader:
    n_kv_max: int
    n_batch: int
    n_ubatch: int
    flash_attn: int
    is_pp_shared: int
    is_tg_separate: int
    n_gpu_layers: int
    n_threads: int
    n_threads_batch: int
    compute_buffer_mib: float
    kv_mib: float


@dataclass(slots=True)
class BatchedResult:
    """One row of llama-batched-bench's table (and its jsonl fields)."""

    pp: int
    tg: int
    pl: int
    n_kv: int
    t_pp: float
    speed_pp: float
    t_tg: float
    speed_tg: float
    t: float
    speed: float


def n_ctx_required(pp: int, tg: int, pl: int, pps: bool, kvu: bool) -> int:
    return ((pp if kvu else pl * pp) + pl * tg) if pps else pl * (pp + tg)


def batched_header(ctx: Context, p: BatchedParams) -> BatchedHeader:
    cp = ctx.cparams
    kv = sum(i.k_bytes + i.v_bytes for i in (c.info() for c in ctx.memory.caches))
    return BatchedHeader(cp.n_ctx, cp.n_batch, cp.n_ubatch, 1, int(p.pps), int(p.tgs), 0,
                         cp.n_threads, cp.n_threads, ctx.reservation.bytes / MiB, kv / MiB)


def _decode_chunks(ctx: Context, batch: Batch) -> None:
    """decode_helper: the batch in views of n_batch slots."""
    nb = ctx.cparams.n_batch
    for i in range(0, batch.n_tokens, nb):
        ctx.decode(Batch(batch.token[i : i + nb], batch.pos[i : i + nb], batch.seq_id[i : i + nb],
                         batch.logits[i : i + nb]))


def run_batched_bench(p: BatchedParams, on_event: Callable[[BenchEvent], None] | None = None,
                      model: Model | None = None) -> tuple[BatchedHeader, list[BatchedResult]]:
    emit = on_event or (lambda e: None)
    for name, vals in (("-npp", p.n_pp), ("-ntg", p.n_tg), ("-npl", p.n_pl)):
        if not vals or any(v < 0 for v in vals):
            raise BenchError(f"{name}: needs non-negative values")
    if any(v < 1 for v in p.n_pl):
        raise BenchError("-npl: every value must be at least 1")
    if model is None:
        emit(BenchEvent("load", text=str(p.model)))
        model = Model.load(p.model)
    ctx = Context(model, ContextParams(n_ctx=p.n_ctx, n_batch=p.n_batch, n_ubatch=p.n_ubatch,
                                       n_seq_max=max(p.n_pl), n_threads=p.n_threads, type_k=p.type_k,
                                       type_v=p.type_v, kv_unified=p.kvu, backend=p.backend))
    cp = ctx.cparams
    header = batched_header(ctx, p)
    rng = np.random.default_rng(p.seed)
    n_vocab = model.hparams.n_vocab
    # warm-up: 16 random tokens
    ctx.decode(Batch.from_tokens(_random_tokens(rng, n_vocab, min(16, cp.n_batch)), 0))
    ctx.memory.clear()
    combos = [(pp, tg, pl) for pp in p.n_pp for tg in p.n_tg for pl in p.n_pl]
    results: list[BatchedResult] = []
    for ci, (pp, tg, pl) in enumerate(combos, 1):
        need = n_ctx_required(pp, tg, pl, p.pps, p.kvu)
        if need > cp.n_ctx:
            emit(BenchEvent("note", ci, len(combos), text=f"skipping PP {pp} TG {tg} B {pl}: needs "
                                                         f"{need} KV cells > n_kv_max {cp.n_ctx}"))
            continue
        if not p.kvu and pp + tg > cp.n_ctx_seq:
            emit(BenchEvent("note", ci, len(combos), text=f"skipping PP {pp} TG {tg} B {pl}: a sequence "
                                                         f"needs {pp + tg} cells > {cp.n_ctx_seq} per "
                                                         f"stream (-c / {max(p.n_pl)} seqs; try -kvu)"))
            continue
        emit(BenchEvent("rep", ci, len(combos), 1, 1, text=f"PP {pp} TG {tg} B {pl}"))
        batch = Batch()
        for s in range(1 if p.pps else pl):
            for j in range(pp):
                batch.add(int(rng.integers(0, n_vocab)), j, s, j == pp - 1)
        ctx.memory.clear()
        t0 = time.perf_counter()
        if batch.n_tokens:
            _decode_chunks(ctx, batch)
        if p.pps and pp:
            for s in range(1, pl):
                ctx.memory.seq_cp(0, s)
            if not p.kvu:  # one dummy token applies the copies to the other streams
                ctx.decode(Batch.from_tokens([int(rng.integers(0, n_vocab))], pp, 0))
                ctx.memory.seq_rm(0, pp, -1)
        t_pp = time.perf_counter() - t0
        for i in range(tg):
            if p.tgs:
                for s in range(pl):
                    ctx.decode(Batch.from_tokens([int(rng.integers(0, n_vocab))], pp + i, s))
            else:
                b = Batch()
                for s in range(pl):
                    b.add(int(rng.integers(0, n_vocab)), pp + i, s, True)
                _decode_chunks(ctx, b)
        t_tg = time.perf_counter() - t_pp - t0
        n_pp_tok = pp if p.pps else pl * pp
        total = t_pp + t_tg
        res = BatchedResult(pp, tg, pl, need, t_pp, n_pp_tok / t_pp if t_pp > 0 else 0.0, t_tg,
                            pl * tg / t_tg if t_tg > 0 else 0.0, total,
                            (n_pp_tok + pl * tg) / total if total > 0 else 0.0)
        results.append(res)
        emit(BenchEvent("done", ci, len(combos), 1, 1, text=f"PP {pp} TG {tg} B {pl}"))
    return header, results


__all__ = [
    "BenchError", "BenchParams", "BenchTest", "BenchResult", "BenchEvent", "TensorShare",
    "BatchedParams", "BatchedHeader", "BatchedResult", "ProfilingOps", "BenchContext",
    "parse_int_range", "int_list", "str_list", "pair_list", "expand", "check_params", "check_tests",
    "run_bench", "run_batched_bench", "run_prompt", "run_gen", "model_description", "n_ctx_required",
    "CATEGORIES", "CATEGORY_TITLES",
]
