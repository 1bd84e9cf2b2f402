"""What one architecture declares, and the core every architecture shares.

An architecture (one module of this package) is an `Arch`: its GGUF name and Hugging Face
`model_type`s, how its hyperparameters are read (`read_core` plus its own fields), its tensors
(`TensorSpec`: name, shape, kind, tensor-parallel cut), its layer's forward graph written with the
shared blocks of `Blocks` (the graph layer implements them), its Hugging Face table and its default
chat template. Everything else (the loader, the tensor-parallel cut, the HF reader, the graph)
reads these declarations, so an architecture is one file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

import numpy as np

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.metadata import (
    MISSING,
    bad_value,
    check_int,
    meta_bool,
    meta_float,
    meta_int,
    meta_per_layer,
    meta_str,
    show,
)
from ubatch.engine.gguf.string_array import StringArray

if TYPE_CHECKING:
    import gguf

LLAMA_MAX_LAYERS = 512  # llama.cpp's bound on block_count
MAX_DIM = 1 << 20  # widths, heads and lengths past this are a corrupt file, not a model
MAX_VOCAB = 1 << 24
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")  # llama_pooling_type 0..4, as GGUF stores it

Meta = Mapping[str, object]
Config = dict[str, object]  # a Hugging Face config.json object: every value is checked where it is read


@dataclass(slots=True, frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    rms_eps: float
    rope_neox: bool  # NEOX pairs (i, i + n_rot/2); NORM pairs (2i, 2i+1)
    rope_freq_base: float
    rope_freq_scale: float
    rope_freq_base_swa: float
    rope_freq_scale_swa: float
    n_swa: int  # 0 = no sliding window
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window
    attn_scale: float  # applied to q after RoPE
    embd_scale: float  # 1.0 = none (llama); sqrt(n_embd) for gemma
    final_logit_softcap: float  # 0 = off
    sandwich_norm: bool  # post-attention / post-FFN norms before the residual add (gemma2, gemma3)
    qk_norm: bool  # per-head RMS norms of Q and K before RoPE
    ffn_act: str  # "silu" (llama) or "gelu_tanh" (gemma)
    causal_attn: bool  # `{arch}.attention.causal` (true when absent): false lets a query see later tokens
    pooling_type: str  # `{arch}.pooling_type` as a POOLING_TYPES name; llama.cpp's default is none
    attn_softcap: float = 0.0  # attention scores soft-capped as c·tanh(s / c) (gemma2); 0 = off
    residual_scale: float = 1.0  # attention and FFN outputs scaled before the residual add (granite)
    logit_scale: float = 1.0  # the logits divided by it (granite)
    rope_layers: tuple[bool, ...] = ()  # per layer: RoPE applied (empty: every layer; smollm3 skips some)
    qk_norm_full: bool = False  # Q and K normed over the whole projection, before the heads (olmo2)
    rope_yarn_factors: tuple[float, ...] = ()  # yarn: each rotated pair's frequency divided by its factor
    # `rope.scaling.original_context_length` (0: n_ctx_train): LongRoPE's long factors apply to a
    # context whose per-sequence length exceeds it
    n_ctx_orig: int = 0
    # cos and sin of every rotated pair scaled by it (yarn's magnitude, `rope.scaling.attn_factor`):
    # on both q and k, so m² on the rotated dims' share of q·k and nothing on unrotated dims
    rope_mscale: float = 1.0
    moe: MoeParams | None = None  # a mixture of experts in place of the dense FFN
    mla: MlaParams | None = None  # multi-head latent attention (deepseek2): the cache holds K only

    @property
    def n_expert(self) -> int:
        return self.moe.n_expert if self.moe else 0

    def is_swa(self, il: int) -> bool:
        return self.swa_layers[il]

    def has_rope(self, il: int) -> bool:
        return not self.rope_layers or self.rope_layers[il]

    def rope_params(self, il: int) -> tuple[float, float]:
        """(freq_base, freq_scale) of layer il: local layers have their own base."""
        if self.swa_layers[il]:
            return self.rope_freq_base_swa, self.rope_freq_scale_swa
        return self.rope_freq_base, self.rope_freq_scale


# llama_expert_gating_func_type as GGUF stores it: how router logits become expert weights
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


@dataclass(slots=True, frozen=True)
class MoeParams:
    """A mixture of experts: the router picks `n_expert_used` of `n_expert` experts per token
    and their outputs are summed with the gating weights (llama.cpp's build_moe_ffn)."""

    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # one expert's FFN width
    gating: str = "softmax"  # softmax over all logits; sigmoid; softmax_weight: over the chosen ones only
    norm_w: bool = False  # the chosen weights divided by their sum
    w_scale: float = 1.0  # then scaled
    n_ff_shexp: int = 0  # the shared experts' FFN width, all of them as one FFN (0: none)
    n_dense_lead: int = 0  # the first layers have the dense FFN instead (deepseek2)
    # group-limited choice (DeepSeek-V3): the experts in n_group equal groups, each group scored by
    # the sum of its two best (biased) probabilities, the choice only among the best n_group_used
    n_group: int = 1
    n_group_used: int = 1


@dataclass(slots=True, frozen=True)
class MlaParams:
    """Multi-head latent attention (DeepSeek-V2/V3) as llama.cpp runs it, with k_b and v_b
    absorbed: each token's KV is one compressed row, the normed latent (kv_lora_rank) then the
    RoPE'd key part (n_rot), shared by every head (one KV head of kv_lora_rank + n_rot, and the
    value is that row's latent, so the cache holds no V). Each head's q splits into no-RoPE and
    RoPE parts; the no-RoPE part times the head's k_b lands in the latent space, and the
    attention's latent output times the head's v_b is the head's value."""

    q_lora_rank: int  # 0: q straight from x (V2-Lite); else x -> q_a -> norm -> q_b
    kv_lora_rank: int
    n_embd_head_k: int  # one head's q·k width before absorption: no-RoPE plus RoPE dims
    n_embd_head_v: int  # one head's value width after v_b


def read_moe(
    meta: Meta, arch: str, source: str, norm_w: bool | None = None, gating: str | None = None, n_ff: object = MISSING
) -> MoeParams:
    """The expert keys every MoE family has; `norm_w` and `gating` where the family fixes them
    (llama.cpp's graph does for qwen3moe), else as the file says; `n_ff`: the experts' width where
    the family's files leave expert_feed_forward_length out (OLMoE's are feed_forward_length wide)."""
    a = f"{arch}."
    n_expert = meta_int(meta, a + "expert_count", source, hi=1 << 16)
    n_used = meta_int(meta, a + "expert_used_count", source, hi=n_expert)
    gate = gating or GATING_FUNCS.get(meta_int(meta, a + "expert_gating_func", source, 1, hi=3), "softmax")
    n_group, n_group_used = _expert_groups(meta, a, source, n_expert, n_used)
    return MoeParams(
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=meta_int(meta, a + "expert_feed_forward_length", source, n_ff, hi=MAX_DIM),
        gating=gate,
        norm_w=meta_bool(meta, a + "expert_weights_norm", source, False) if norm_w is None else norm_w,
        w_scale=meta_float(meta, a + "expert_weights_scale", source, 1.0) or 1.0,
        n_ff_shexp=meta_int(meta, a + "expert_shared_feed_forward_length", source, 0, lo=0, hi=MAX_DIM),
        n_group=n_group,
        n_group_used=n_group_used,
    )


def _expert_groups(meta: Meta, a: str, source: str, n_expert: int, n_used: int) -> tuple[int, int]:
    """`expert_group_count` / `expert_group_used_count` (the converter's n_group / topk_group),
    which llama.cpp's build_moe_ffn applies to any family when the count is above 1. A group is
    scored by its two best experts, so it needs two; the kept groups must hold the k chosen."""
    n_group = meta_int(meta, a + "expert_group_count", source, 0, lo=0, hi=n_expert)
    if n_group <= 1:
        return 1, 1
    if n_expert % n_group or n_expert // n_group < 2:
        raise bad_value(
            source, a + "expert_group_count", n_group, f"a divisor of expert_count = {n_expert} with 2+ experts a group"
        )
    per = n_expert // n_group
    used = meta_int(meta, a + "expert_group_used_count", source, hi=n_group)
    if used * per < n_used:
        raise bad_value(
            source, a + "expert_group_used_count", used, f"enough groups of {per} for expert_used_count = {n_used}"
        )
    return n_group, used


def swa_pattern(meta: Meta, arch: str, n_layer: int, n_swa: int, source: str, default: int) -> tuple[bool, ...]:
    """Per layer, whether it uses the sliding window: `sliding_window_pattern` as a period (every
    period-th layer global) or one boolean per layer."""
    if n_swa <= 0:
        return (False,) * n_layer
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = meta.get(key, default)
    if isinstance(pattern, (list, np.ndarray)):
        if len(pattern) != n_layer or not all(isinstance(x, (bool, np.bool_)) or x in (0, 1) for x in pattern):
            raise bad_value(source, key, pattern, f"a period or an array of block_count = {n_layer} booleans")
        return tuple(bool(x) for x in pattern)
    period = check_int(source, key, pattern, 0, 1 << 20)
    if period == 0:
        return (True,) * n_layer
    return tuple((il % period) < period - 1 for il in range(n_layer))


def read_core(meta: Meta, arch: str, source: str) -> HParams:
    """The keys every architecture has, each checked for type and range (llama.cpp's defaults for
    the absent ones); the architecture's module then sets its own fields (`dataclasses.replace`)."""
    a = f"{arch}."
    n_layer = meta_int(meta, a + "block_count", source, hi=LLAMA_MAX_LAYERS)
    n_embd = meta_int(meta, a + "embedding_length", source, hi=MAX_DIM)
    n_head = meta_per_layer(meta, a + "attention.head_count", source, n_layer, hi=MAX_DIM)
    n_head_kv = meta_per_layer(meta, a + "attention.head_count_kv", source, n_layer, n_head, hi=n_head)
    if n_head % n_head_kv:
        raise bad_value(source, a + "attention.head_count_kv", n_head_kv, f"a divisor of head_count = {n_head}")
    n_ff = meta_per_layer(meta, a + "feed_forward_length", source, n_layer, hi=MAX_DIM)
    head_k = meta_int(meta, a + "attention.key_length", source, n_embd // n_head, hi=MAX_DIM)
    head_v = meta_int(meta, a + "attention.value_length", source, n_embd // n_head, hi=MAX_DIM)
    n_rot = meta_int(meta, a + "rope.dimension_count", source, head_k, hi=head_k)
    if n_rot % 2:
        raise bad_value(source, a + "rope.dimension_count", n_rot, "an even number (RoPE rotates pairs)")
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, (list, np.ndarray, StringArray)) else 0
    n_vocab = meta_int(meta, a + "vocab_size", source, n_tokens or MISSING, hi=MAX_VOCAB)
    linear = meta_float(meta, a + "rope.scale_linear", source, 0.0)
    scale_factor = meta_float(meta, a + "rope.scaling.factor", source, linear)
    scaling_type = meta_str(meta, a + "rope.scaling.type", source, "linear")
    if scaling_type not in ("none", "linear", "yarn"):
        raise ModelLoadError(f"{source}: rope scaling {scaling_type!r} is not supported (only linear and yarn)")
    freq_scale = 1.0 / scale_factor if scale_factor and scaling_type in ("linear", "yarn") else 1.0
    freq_base = meta_float(meta, a + "rope.freq_base", source, 10000.0, positive=True)
    n_ctx_train = meta_int(meta, a + "context_length", source)
    yarn_factors: tuple[float, ...] = ()
    # cos and sin scaled by it (llama.cpp multiplies every context's attention factor by it; phi3's
    # LongRoPE files write it), on top of yarn's own magnitude
    mscale = meta_float(meta, a + "rope.scaling.attn_factor", source, 1.0, positive=True)
    n_ctx_orig = meta_int(meta, a + "rope.scaling.original_context_length", source, n_ctx_train)
    if scaling_type == "yarn" and freq_scale != 1.0:
        yarn_factors, yarn_mscale = _yarn(meta, a, source, n_rot, freq_base, freq_scale, n_ctx_orig)
        mscale *= yarn_mscale
        freq_scale = 1.0  # carried by the per-pair factors
    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_rot=n_rot,
        rms_eps=meta_float(meta, a + "attention.layer_norm_rms_epsilon", source, positive=True),
        rope_neox=False,
        rope_freq_base=freq_base,
        rope_freq_scale=freq_scale,
        rope_freq_base_swa=meta_float(meta, a + "rope.freq_base_swa", source, 10000.0, positive=True),
        rope_freq_scale_swa=1.0,
        n_swa=0,
        swa_layers=(False,) * n_layer,
        attn_scale=1.0 / math.sqrt(head_k),
        embd_scale=1.0,
        final_logit_softcap=meta_float(meta, a + "final_logit_softcapping", source, 0.0),
        sandwich_norm=False,
        qk_norm=False,
        ffn_act="silu",
        causal_attn=meta_bool(meta, a + "attention.causal", source, True),
        pooling_type=POOLING_TYPES[meta_int(meta, a + "pooling_type", source, 0, lo=0, hi=len(POOLING_TYPES) - 1)],
        rope_yarn_factors=yarn_factors,
        n_ctx_orig=n_ctx_orig,
        rope_mscale=mscale,
    )


def _yarn(
    meta: Meta, a: str, source: str, n_rot: int, base: float, freq_scale: float, orig: int
) -> tuple[tuple[float, ...], float]:
    """YaRN as ggml computes it (ggml_rope_yarn_corr_dims, rope_yarn; llama_context's attention
    factor), as per-pair divisors of each frequency and the cos/sin magnitude. A pair's angle is
    the interpolated one mixed with the extrapolated by the ramp: theta·(s·(1 - r) + r), so its
    divisor is 1 / (s·(1 - r) + r); the magnitude m scales both q and k, which is m² on q·k."""
    ext = meta_float(meta, a + "rope.scaling.yarn_ext_factor", source, 1.0)  # llama.cpp: unset is 1 under yarn
    fast = meta_float(meta, a + "rope.scaling.yarn_beta_fast", source, 32.0)
    slow = meta_float(meta, a + "rope.scaling.yarn_beta_slow", source, 1.0)
    log_mul = meta_float(meta, a + "rope.scaling.yarn_log_multiplier", source, 0.0)

    def corr_dim(n_rot_beta: float) -> float:
        return n_rot * math.log(orig / (n_rot_beta * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(0.0, math.floor(corr_dim(fast))), min(n_rot - 1.0, math.ceil(corr_dim(slow)))
    factors = []
    for i in range(n_rot // 2):
        ramp = (1 - min(1.0, max(0.0, (i - lo) / max(0.001, hi - lo)))) * ext
        factors.append(1.0 / (freq_scale * (1 - ramp) + ramp))

    def mscale(f: float, m: float) -> float:
        return 1.0 if f <= 1.0 else 0.1 * m * math.log(f) + 1.0

    f = 1.0 / freq_scale
    if ext != 0:
        attn = (mscale(f, 1.0) / mscale(f, log_mul) if log_mul else mscale(f, 1.0)) / (1 + 0.1 * math.log(f))
        m = attn * (1 + 0.1 * math.log(f))
    else:
        m = meta_float(meta, a + "rope.scaling.yarn_attn_factor", source, 1.0)
    return tuple(factors), m


# -- tensors --------------------------------------------------------------------------------------
# matrix: multiplied with (kept as stored, quantised); vector: a norm weight (f32); bias: added to a
# projection's output (f32); fused: several matrices in one tensor, split by views
# experts: one matrix per expert stacked as a 3-D tensor (E, rows, cols), kept as stored
Kind = Literal["matrix", "vector", "bias", "fused", "experts"]
# how tensor parallelism cuts it: output rows by query heads, KV heads (K's or V's width) or FFN
# rows; input columns by query heads or FFN rows; the vocabulary; every rank holds it whole; or
# "none": it spans what ranks split (a norm over every head's values), so -tp is refused; each
# expert's rows or input columns of its FFN (exp_rows, exp_cols: vLLM's default cut of experts);
# the shared experts' rows or input columns (sh_rows, sh_cols: a dense FFN of their own width)
# heads: one value per query head (gpt-oss's sinks); summed: a bias added after the ranks' partial
# sums are reduced, so rank 0 alone adds it; exp_gate_up: each expert's gate rows then up rows in
# one matrix, each half cut as exp_rows; head_exps: a per-head 3-D tensor (deepseek2's k_b, v_b),
# this rank's heads
Cut = Literal[
    "q_rows", "k_rows", "v_rows", "ff_rows", "q_cols", "ff_cols", "exp_rows", "exp_cols", "sh_rows", "sh_cols",
    "exp_gate_up", "head_exps", "heads", "summed",
    "vocab", "replicated", "none",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorSpec:
    field: str  # the key the weight has in LayerWeights (or the Model field)
    name: str  # the GGUF tensor name
    shape: tuple[int, ...]  # torch order, as the hparams imply it
    kind: Kind
    cut: Cut
    required: bool = True
    # a fused tensor's parts, in row order: (field, rows, cut); each part is a view of its rows
    parts: tuple[tuple[str, int, Cut], ...] = ()
    # the fields of the tensors this one stands in for where a file holds it (then it holds none
    # of them); where it does not, they are required as declared (llama.cpp's "fused, or else")
    instead_of: tuple[str, ...] = ()

    @property
    def stored_as_matrix(self) -> bool:
        """Kept in its GGUF storage type (a QWeight); else read once as an f32 tensor."""
        return self.kind in ("matrix", "fused", "experts")


def attn_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    """The attention projections every architecture here has (llama's names)."""
    d, dk, dv, p = hp.n_embd, hp.n_embd_head_k, hp.n_embd_head_v, f"blk.{il}."
    return [
        TensorSpec("attn_norm", p + "attn_norm.weight", (d,), "vector", "replicated"),
        TensorSpec("wq", p + "attn_q.weight", (hp.n_head * dk, d), "matrix", "q_rows"),
        TensorSpec("wk", p + "attn_k.weight", (hp.n_head_kv * dk, d), "matrix", "k_rows"),
        TensorSpec("wv", p + "attn_v.weight", (hp.n_head_kv * dv, d), "matrix", "v_rows"),
        TensorSpec("wo", p + "attn_output.weight", (d, hp.n_head * dv), "matrix", "q_cols"),
    ]


def ffn_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    """The gated FFN (gate, up, down) and its pre-norm."""
    d, p = hp.n_embd, f"blk.{il}."
    return [
        TensorSpec("ffn_norm", p + "ffn_norm.weight", (d,), "vector", "replicated"),
        TensorSpec("ffn_gate", p + "ffn_gate.weight", (hp.n_ff, d), "matrix", "ff_rows"),
        TensorSpec("ffn_up", p + "ffn_up.weight", (hp.n_ff, d), "matrix", "ff_rows"),
        TensorSpec("ffn_down", p + "ffn_down.weight", (d, hp.n_ff), "matrix", "ff_cols"),
    ]


def moe_tensors(
    hp: HParams, il: int, norm: bool = True, biases: bool = False, gate_up: bool = False
) -> list[TensorSpec]:
    """The router and the experts' gate, up and down (3-D: one matrix per expert), the pre-norm
    (`ffn_norm`) where the family names it so, and the router's and experts' biases (gpt-oss).
    `gate_up`: a file may hold each expert's gate and up as one matrix, gate rows first
    (`ffn_gate_up_exps`, where llama.cpp's loader takes it: create_tensor_gate_up_exps)."""
    assert hp.moe is not None
    d, p, e, f = hp.n_embd, f"blk.{il}.", hp.moe.n_expert, hp.moe.n_ff_exp
    out = [TensorSpec("ffn_norm", p + "ffn_norm.weight", (d,), "vector", "replicated")] if norm else []
    out += [
        TensorSpec("ffn_gate_inp", p + "ffn_gate_inp.weight", (e, d), "matrix", "replicated"),
        TensorSpec("ffn_gate_exps", p + "ffn_gate_exps.weight", (e, f, d), "experts", "exp_rows"),
        TensorSpec("ffn_up_exps", p + "ffn_up_exps.weight", (e, f, d), "experts", "exp_rows"),
        TensorSpec("ffn_down_exps", p + "ffn_down_exps.weight", (e, d, f), "experts", "exp_cols"),
    ]
    if gate_up:
        out.append(
            TensorSpec("ffn_gate_up_exps", p + "ffn_gate_up_exps.weight", (e, 2 * f, d), "experts", "exp_gate_up",
                       False, instead_of=("ffn_gate_exps", "ffn_up_exps"))
        )  # fmt: skip
    if biases:
        out += [
            TensorSpec("ffn_gate_inp_b", p + "ffn_gate_inp.bias", (e,), "bias", "replicated"),
            TensorSpec("ffn_gate_exps_b", p + "ffn_gate_exps.bias", (e, f), "bias", "exp_rows"),
            TensorSpec("ffn_up_exps_b", p + "ffn_up_exps.bias", (e, f), "bias", "exp_rows"),
            TensorSpec("ffn_down_exps_b", p + "ffn_down_exps.bias", (e, d), "bias", "summed"),
        ]
    return out


def shexp_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    """The shared experts (every token runs them beside its chosen ones) as one gated FFN."""
    assert hp.moe is not None
    d, f, p = hp.n_embd, hp.moe.n_ff_shexp, f"blk.{il}."
    return [
        TensorSpec("ffn_gate_shexp", p + "ffn_gate_shexp.weight", (f, d), "matrix", "sh_rows"),
        TensorSpec("ffn_up_shexp", p + "ffn_up_shexp.weight", (f, d), "matrix", "sh_rows"),
        TensorSpec("ffn_down_shexp", p + "ffn_down_shexp.weight", (d, f), "matrix", "sh_cols"),
    ]


def qk_norm_tensors(hp: HParams, il: int, required: bool) -> list[TensorSpec]:
    """Per-head RMS norms of Q and K (one head's width, shared by the heads)."""
    dk, p = hp.n_embd_head_k, f"blk.{il}."
    return [
        TensorSpec("q_norm", p + "attn_q_norm.weight", (dk,), "vector", "replicated", required),
        TensorSpec("k_norm", p + "attn_k_norm.weight", (dk,), "vector", "replicated", required),
    ]


def model_tensors(hp: HParams) -> dict[str, TensorSpec]:
    """The tensors outside the layers, by the Model field each one fills."""
    d, v = hp.n_embd, hp.n_vocab
    return {
        "tok_embd": TensorSpec("tok_embd", "token_embd.weight", (v, d), "matrix", "vocab"),
        # absent: tied to token_embd
        "output": TensorSpec("output", "output.weight", (v, d), "matrix", "vocab", False),
        "output_norm": TensorSpec("output_norm", "output_norm.weight", (d,), "vector", "replicated"),
        "rope_freqs": TensorSpec("rope_freqs", "rope_freqs.weight", (hp.n_rot // 2,), "vector", "replicated", False),
        # LongRoPE (phi3's 128k files): per-pair divisors for long and for short contexts
        "rope_long": TensorSpec(
            "rope_long", "rope_factors_long.weight", (hp.n_rot // 2,), "vector", "replicated", False
        ),
        "rope_short": TensorSpec(
            "rope_short", "rope_factors_short.weight", (hp.n_rot // 2,), "vector", "replicated", False
        ),
    }


# -- the forward graph ----------------------------------------------------------------------------
T = TypeVar("T")


class Blocks(Protocol[T]):
    """The shared blocks an architecture's layer is written with (engine/graph/blocks.py builds
    them as graph nodes). Weights are named by their `TensorSpec.field`; the blocks carry the
    tensor-parallel all-reduces themselves, so a layer reads the same with and without -tp."""

    @property
    def hp(self) -> HParams:
        """The hyperparameters of the model (one rank's under -tp)."""

    def norm(self, x: T, il: int, field: str, name: str) -> T:
        """RMS norm of x with the layer's weight `field`."""

    def attention(self, x: T, il: int) -> T:
        """Self-attention of the normed rows x: Q/K/V (with biases and Q/K norms, per head or over
        the projection, where the hparams say), RoPE where the layer has it, the KV cache, the
        output projection, whole again across ranks."""

    def ffn(self, x: T, il: int) -> T:
        """The gated FFN of the normed rows x, whole again across ranks."""

    def moe(self, x: T, il: int) -> T:
        """The mixture of experts of the normed rows x: the router's logits, each row's chosen
        experts and their weights, the chosen experts' gated FFNs summed with those weights."""

    def scale(self, x: T, s: float, name: str) -> T: ...

    def residual(self, x: T, a: T, il: int) -> T:
        """x + a after attention (`ffn_inp`); at the last layer only the output rows are kept."""

    def add(self, a: T, b: T, name: str) -> T: ...


class LayerGraph(Protocol):
    """An architecture's layer: the residual stream x in, out, written with the shared blocks."""

    def __call__(self, b: Blocks[T], il: int, x: T) -> T: ...


# -- Hugging Face checkpoints ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HFTable:
    """How llama.cpp's converter reads this architecture's Hugging Face checkpoint."""

    layer_names: Mapping[str, str]  # HF module under model.layers.N -> GGUF tensor stem under blk.N
    write_hparams: Callable[[gguf.GGUFWriter, Config, str], None]  # config.json -> the GGUF keys
    permute_qk: bool = False  # Q/K rows from HF's rotate-half order to GGUF's interleaved pairs
    norm_shift: bool = False  # norms stored as w, run as 1 + w (the converter adds the 1)
    trim_vocab: bool = False  # embedding rows past vocab_size (padding) are dropped
    space_prefix: Literal["config", "never", "unset"] = "unset"  # tokenizer.ggml.add_space_prefix
    # model_types that wrap the text model (e.g. a multimodal one): the text config's model_type
    text_config: Mapping[str, str] = field(default_factory=dict)
    # tensors the converter computes from config.json rather than reads (llama3's rope_freqs), by name
    extra_tensors: Callable[[Config, str], dict[str, np.ndarray]] | None = None
    # the HF module of each layer's experts, one FFN per expert (`mlp.experts` + `.E.gate_proj`...),
    # which the converter stacks into ffn_{gate,up,down}_exps; "": the checkpoint has none
    experts: str = ""
    # HF tensors the converter rewrites into others (deepseek2's kv_b, split per head), by the
    # GGUF stem layer_names maps them to
    rewrites: Mapping[str, HFRewrite] = field(default_factory=dict)
    # why -m DIR does not read this family's checkpoints ("": it does), said in one line
    refused: str = ""


@dataclass(frozen=True, slots=True)
class HFRewrite:
    """One HF tensor made into the GGUF tensors `stems` (of its layer) by `fn`."""

    stems: tuple[str, ...]
    fn: Callable[[np.ndarray, HParams], dict[str, np.ndarray]]


@dataclass(frozen=True, slots=True)
class Arch:
    """One architecture, as its module declares it."""

    name: str  # general.architecture
    hf_model_types: tuple[str, ...]
    read_hparams: Callable[[Meta, str], HParams]  # read_core and the architecture's own fields
    layer_tensors: Callable[[HParams, int], list[TensorSpec]]
    layer: LayerGraph
    hf: HFTable
    chat_template: str  # llama.cpp's built-in template when the file has none
    # tensors a file of this architecture may hold that ubatch cannot run yet: (GGUF name, why)
    refused: tuple[tuple[str, str], ...] = ()

    def specs(self, hp: HParams, il: int) -> dict[str, TensorSpec]:
        """Layer il's tensors by field."""
        return {t.field: t for t in self.layer_tensors(hp, il)}

    def cuts(self, hp: HParams, il: int) -> dict[str, Cut]:
        """How -tp cuts each of layer il's weights, by field (a fused tensor's parts by theirs)."""
        out: dict[str, Cut] = {}
        for t in self.layer_tensors(hp, il):
            out |= {f: cut for f, _, cut in t.parts} if t.parts else {t.field: t.cut}
        return out


def unknown(arch: object, source: str, supported: tuple[str, ...]) -> ModelLoadError:
    return ModelLoadError(
        f"{source}: general.architecture {show(arch)} is not supported; ubatch runs {', '.join(supported)}"
    )
