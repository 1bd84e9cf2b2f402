"""Context parameters (-c -b -ub -np ...) and llama.cpp's derivation of the effective values."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType as T

from ubatch.engine.errors import ContextError
from ubatch.engine.model.hparams import HParams

# cache type name -> (ggml type, torch dtype for float types or None for quantised)
KV_TYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "f32": (T.F32, torch.float32),
    "f16": (T.F16, torch.float16),
    "bf16": (T.BF16, torch.bfloat16),
    "q8_0": (T.Q8_0, None),
    "q4_0": (T.Q4_0, None),
}


def round_up(x: int, n: int) -> int:
    return -(-x // n) * n


LLAMA_MAX_SEQ = 256
N_CTX_PAD = 256


@dataclass(slots=True)
class ContextParams:
    """What the user asked for; 0 means 'derive it' where llama.cpp says so."""

    n_ctx: int = 0  # 0 = the model's training context
    n_batch: int = 2048
    n_ubatch: int = 512  # 0 = n_batch
    n_seq_max: int = 1
    n_threads: int = 0  # 0 = all cores torch sees
    n_outputs_max: int = 0  # 0 = n_batch
    type_k: str = "f16"
    type_v: str = "f16"
    kv_unified: bool = False
    swa_full: bool = False
    causal_attn: bool = True
    backend: str = "auto"  # op backend (kernels.backends): auto, cpu, cpu-avx2, cpu-portable, torch


@dataclass(frozen=True, slots=True)
class Step:
    """One rule of `derive` that changed a value (`ubatch explain` shows them as they fired)."""

    name: str
    given: int
    value: int
    rule: str  # why, worded to follow "because"


@dataclass(slots=True)
class CParams:
    """The effective values a context runs with, after llama.cpp's clamps and rounding."""

    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_outputs_max: int
    n_threads: int
    type_k: str
    type_v: str
    kv_unified: bool
    swa_full: bool
    causal_attn: bool
    warnings: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)  # each clamp or rounding that changed a value


def derive(p: ContextParams, hp: HParams) -> CParams:
    """llama_context's constructor, in order (reference/llamacpp-runtime.md §1.3)."""
    if p.n_batch <= 0 and p.n_ubatch <= 0:
        raise ContextError("n_batch and n_ubatch cannot both be zero")
    if p.n_batch < 0 or p.n_ubatch < 0 or p.n_ctx < 0:
        raise ContextError("-c, -b and -ub must not be negative")
    n_seq_max = max(1, p.n_seq_max)
    if n_seq_max > LLAMA_MAX_SEQ:
        raise ContextError(f"n_seq_max must be <= {LLAMA_MAX_SEQ}")
    for t in (p.type_k, p.type_v):
        if t not in KV_TYPES:
            raise ContextError(f"unsupported KV cache type {t!r}; use one of {', '.join(KV_TYPES)}")
    steps: list[Step] = []

    def step(name: str, given: int, value: int, rule: str) -> None:
        if given != value:
            steps.append(Step(name, given, value, rule))

    if p.n_seq_max < 1:
        step("n_seq_max", p.n_seq_max, n_seq_max, "at least one sequence")
    n_ctx = p.n_ctx or hp.n_ctx_train
    step("n_ctx", p.n_ctx, n_ctx, f"-c 0 takes the model's training context (n_ctx_train = {hp.n_ctx_train})")
    # n_batch is clamped with the requested n_ctx, before it is padded
    n_batch = min(n_ctx, p.n_batch) if p.causal_attn else p.n_batch
    step("n_batch", p.n_batch, n_batch, f"n_ctx = {n_ctx} (a decode call never holds more than the context)")
    n_ubatch = p.n_ubatch or p.n_batch
    step("n_ubatch", p.n_ubatch, n_ubatch, "-ub 0 takes n_batch")
    step("n_ubatch", n_ubatch, min(n_batch, n_ubatch), f"n_batch = {n_batch} (a ubatch is a piece of one batch)")
    n_ubatch = min(n_batch, n_ubatch)
    n_outputs_max = n_batch if p.n_outputs_max == 0 else min(p.n_outputs_max, n_batch)
    why = "0 takes n_batch" if p.n_outputs_max == 0 else f"n_batch = {n_batch} (at most one output per row)"
    step("n_outputs_max", p.n_outputs_max, n_outputs_max, why)
    step("n_ctx", n_ctx, round_up(n_ctx, N_CTX_PAD), f"n_ctx is padded to a multiple of {N_CTX_PAD}")
    n_ctx = round_up(n_ctx, N_CTX_PAD)
    warnings: list[str] = []
    if p.kv_unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = round_up(n_ctx // n_seq_max, N_CTX_PAD)
        if n_ctx_seq == 0:
            raise ContextError("n_ctx_seq == 0: the context is too small for that many sequences")
        step(
            "n_ctx_seq",
            n_ctx,
            n_ctx_seq,
            f"each of n_seq_max = {n_seq_max} sequences has its own stream: n_ctx / {n_seq_max}, "
            f"rounded up to {N_CTX_PAD} (-kvu shares one)",
        )
        if n_ctx != n_ctx_seq * n_seq_max:
            step("n_ctx", n_ctx, n_ctx_seq * n_seq_max, f"n_ctx = n_ctx_seq x n_seq_max = {n_ctx_seq} x {n_seq_max}")
            n_ctx = n_ctx_seq * n_seq_max
            warnings.append(f"n_ctx is not divisible by n_seq_max - rounding down to {n_ctx}")
    if n_ctx_seq > hp.n_ctx_train:
        warnings.append(
            f"n_ctx_seq ({n_ctx_seq}) > n_ctx_train ({hp.n_ctx_train}) -- possible training context overflow"
        )
    n_threads = p.n_threads
    if n_threads <= 0:
        import os

        n_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return CParams(
        n_ctx,
        n_ctx_seq,
        n_batch,
        n_ubatch,
        n_seq_max,
        n_outputs_max,
        n_threads,
        p.type_k,
        p.type_v,
        p.kv_unified,
        p.swa_full,
        p.causal_attn,
        warnings,
        steps,
    )


def context_holds(p: ContextParams, cp: CParams) -> str:
    """The words "the context holds N", naming the rule that made N differ from the -c the user
    gave (llama.cpp pads n_ctx to a multiple of 256, -c 0 takes the training context, -np splits
    it): a bare 256 after `-c 64` reads like a bug."""
    n, asked = cp.n_ctx_seq, p.n_ctx
    why = ""
    if cp.n_seq_max > 1 and not cp.kv_unified:
        if n != asked:
            why = f"-c {asked} -np {cp.n_seq_max} -> n_ctx_seq {n} per sequence"
    elif asked == 0:
        why = f"-c 0 -> n_ctx {n}, the model's training context"
    elif n != asked:
        why = f"-c {asked} -> n_ctx {n}, padded to a multiple of {N_CTX_PAD}"
    return f"the context holds {n}" + (f" ({why})" if why else "")
