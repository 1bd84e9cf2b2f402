"""LoRA adapters: low-rank pairs (A, B) added to a base model's matrices, never merged into them.

An adapter comes from a GGUF file as llama.cpp's convert_lora_to_gguf.py writes it (`general.type
= adapter`, `adapter.type = lora`, `adapter.lora.alpha`, a `<base name>.lora_a` and `.lora_b` per
targeted matrix) or from a PEFT directory (adapter_config.json + adapter_model.safetensors, read
by engine/model/hf/peft.py into the same names). Each pair is checked against the base model's
tensor of that name, as llama.cpp's llama_adapter_lora_init checks it, with one-line errors.

The forward pass (engine/graph/blocks.py) computes `y = W x + scale * B (A x)` for every adapter
of a ubatch in one segmented kernel call per targeted matrix (kernels/ops.py `LoraArgs`): each
matrix's pairs of all loaded adapters are stacked once (`stack_adapters`, Punica's layout), and
each row gathers its own. `LoraWeight.scale` is llama.cpp's get_scale.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.file import TensorInfo, open_gguf
from ubatch.engine.model.archs import layer_specs
from ubatch.engine.model.hf.peft import read_peft
from ubatch.engine.model.hparams import HParams
from ubatch.kernels.ops import LoraStack
from ubatch.kernels.quant.dequant import UnsupportedTypeError, check_supported
from ubatch.kernels.quant.weight import QWeight


@dataclass(eq=False, slots=True)
class LoraWeight:
    """One targeted matrix's pair: A (rank, n_in) and B (n_out, rank), as stored."""

    a: QWeight
    b: QWeight

    @property
    def rank(self) -> int:
        return self.b.shape[1]

    def scale(self, alpha: float, user_scale: float) -> float:
        """llama.cpp's get_scale: alpha / rank times the user's scale; alpha 0 means 'no alpha'."""
        return user_scale * alpha / self.rank if alpha else user_scale


@dataclass(eq=False, slots=True)
class LoraAdapter:
    """A loaded adapter: its pairs by layer and LayerWeights field, its alpha, where it came from."""

    path: Path
    alpha: float
    layers: list[dict[str, LoraWeight]]
    output: LoraWeight | None = None  # the output head's pair (lm_head), where the adapter has one
    name: str = ""
    meta: dict[str, str] = field(default_factory=dict)  # its GGUF string keys (llama.cpp's gguf_kv)
    # its slabs of the stacks the kernels read (`stack_adapters`: rank-padded, 0 until stacked)
    held_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """What it holds: its share of the stacks (else its pairs as stored)."""
        pairs = [w for L in self.layers for w in L.values()] + ([self.output] if self.output else [])
        return self.held_bytes or sum(w.a.nbytes + w.b.nbytes for w in pairs)

    @property
    def n_pairs(self) -> int:
        return sum(len(L) for L in self.layers) + (self.output is not None)


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """An adapter as the memory plan, `info` and the server's lists show it."""

    id: int
    path: str
    name: str
    n_pairs: int  # matrices it targets
    ranks: tuple[int, ...]  # the distinct ranks of its pairs
    alpha: float
    nbytes: int
    task_name: str = ""  # adapter.lora.task_name, as llama-server lists it
    prompt_prefix: str = ""  # adapter.lora.prompt_prefix


def adapter_infos(adapters: list[LoraAdapter]) -> list[AdapterInfo]:
    out = []
    for i, a in enumerate(adapters):
        pairs = [w for L in a.layers for w in L.values()] + ([a.output] if a.output else [])
        ranks = tuple(sorted({w.rank for w in pairs}))
        task, prefix = a.meta.get("adapter.lora.task_name", ""), a.meta.get("adapter.lora.prompt_prefix", "")
        out.append(AdapterInfo(i, str(a.path), a.name, a.n_pairs, ranks, a.alpha, a.nbytes, task, prefix))
    return out


OUTPUT_KEY = (-1, "output")  # the output head's stack in `stack_adapters`' table
# stacks of pairs all stored in one of these types keep it; any other mix is stacked as f32 (exact)
_STACK_DTYPES = {int(T.F16): torch.float16, int(T.BF16): torch.bfloat16, int(T.F32): torch.float32}


def stack_adapters(adapters: list[LoraAdapter], dev: torch.device) -> dict[tuple[int, str], LoraStack]:
    """Per targeted matrix ((layer, LayerWeights field), or OUTPUT_KEY), every adapter's pair side
    by side, zero-padded to the largest rank, B transposed so that a row's B product is a sum of
    rank rows (kernels/ops.py `LoraStack`); an adapter that does not target a matrix has rank 0."""
    by_key: dict[tuple[int, str], list[LoraWeight | None]] = {}
    for k, ad in enumerate(adapters):
        pairs = [((il, f), w) for il, L in enumerate(ad.layers) for f, w in L.items()]
        if ad.output is not None:
            pairs.append((OUTPUT_KEY, ad.output))
        for key, w in pairs:
            by_key.setdefault(key, [None] * len(adapters))[k] = w
    out: dict[tuple[int, str], LoraStack] = {}
    for key, ws in by_key.items():
        present = [w for w in ws if w is not None]
        types = {t for w in present for t in (w.a.ggml_type, w.b.ggml_type)}
        dt = _STACK_DTYPES.get(types.pop(), torch.float32) if len(types) == 1 else torch.float32
        r, n_in, n_out = max(w.rank for w in present), present[0].a.shape[1], present[0].b.shape[0]
        a = torch.zeros(len(ws), r, n_in, dtype=dt, device=dev)
        bt = torch.zeros(len(ws), r, n_out, dtype=dt, device=dev)
        rank, c = torch.zeros(len(ws), dtype=torch.int32), torch.zeros(len(ws), dtype=torch.float32)
        for k, pw in enumerate(ws):
            if pw is not None:
                a[k, : pw.rank] = pw.a.dense(dt)
                bt[k, : pw.rank] = pw.b.dense(dt).t()
                rank[k], c[k] = pw.rank, pw.scale(adapters[k].alpha, 1.0)
        out[key] = LoraStack(a, bt, rank.to(dev), c.to(dev))
    for k, ad in enumerate(adapters):
        ad.held_bytes = sum(s.a[k].nbytes + s.bt[k].nbytes for s in out.values())
    return out


def _pairs(tensors: dict[str, TensorInfo], src: str) -> dict[str, tuple[TensorInfo, TensorInfo]]:
    """Base tensor name -> (lora_a, lora_b); norms (mergekit) skipped as llama.cpp skips them."""
    a: dict[str, TensorInfo] = {}
    b: dict[str, TensorInfo] = {}
    for name, t in tensors.items():
        if name.endswith(".lora_a"):
            a[name.removesuffix(".lora_a")] = t
        elif name.endswith(".lora_b"):
            b[name.removesuffix(".lora_b")] = t
        elif not name.endswith("_norm.weight"):
            raise ModelLoadError(f"{src}: tensor {name!r} is neither a .lora_a nor a .lora_b; not a LoRA adapter")
    for base in sorted(a.keys() ^ b.keys()):
        raise ModelLoadError(f"{src}: {base!r} has only one of its lora_a/lora_b pair; the adapter is incomplete")
    return {k: (a[k], b[k]) for k in sorted(a)}


def build_adapter(tensors: dict[str, TensorInfo], alpha: float, hp: HParams, src: Path, name: str = "") -> LoraAdapter:
    """The adapter's pairs placed on the base model's matrices, each checked (name, shapes, type)."""
    where: dict[str, tuple[int, str]] = {}
    for il in range(hp.n_layer):
        for spec in layer_specs(hp, il).values():
            if spec.stored_as_matrix and len(spec.shape) == 2:  # expert tensors are 3-D
                where[spec.name] = (il, "" if spec.parts else spec.field)
    layers: list[dict[str, LoraWeight]] = [{} for _ in range(hp.n_layer)]
    output = None

    def qw(t: TensorInfo) -> QWeight:
        try:
            check_supported(t.ggml_type, f"{src}: tensor {t.name!r}")
        except UnsupportedTypeError as e:
            raise ModelLoadError(str(e)) from None
        if len(t.shape) != 2:
            raise ModelLoadError(f"{src}: tensor {t.name!r} has shape {t.shape}; a LoRA factor is a matrix")
        raw = torch.from_numpy(t.data)
        return QWeight(t.name, raw, t.ggml_type, t.shape)  # host bytes: the stacks go to the device

    for base, (ta, tb) in _pairs(tensors, str(src)).items():
        if base == "output.weight":
            n_out, n_in = hp.n_vocab, hp.n_embd
        elif base in where:
            il, fld = where[base]
            if not fld:
                raise ModelLoadError(f"{src}: LoRA on the fused tensor {base!r} is not supported yet")
            spec = layer_specs(hp, il)[fld]
            n_out, n_in = spec.shape
        elif base == "token_embd.weight":
            raise ModelLoadError(f"{src}: LoRA on token_embd.weight (new tokens) is not supported")
        else:
            raise ModelLoadError(
                f"{src}: LoRA tensor {base!r} does not exist in the base {hp.arch} model; is this the adapter's base model?"
            )
        if ta.shape[1:] != (n_in,) or tb.shape[:1] != (n_out,):
            raise ModelLoadError(
                f"{src}: tensor {base!r} has lora_a {ta.shape} and lora_b {tb.shape}, but the base model's is "
                f"({n_out}, {n_in}); is this the adapter's base model?"
            )
        if ta.shape[0] != tb.shape[1]:
            raise ModelLoadError(f"{src}: {base!r}: lora_a's rank {ta.shape[0]} differs from lora_b's {tb.shape[1]}")
        w = LoraWeight(qw(ta), qw(tb))
        if base == "output.weight":
            output = w
        else:
            layers[where[base][0]][where[base][1]] = w
    if not any(layers) and output is None:
        raise ModelLoadError(f"{src}: the adapter targets no matrix of the model")
    return LoraAdapter(src, alpha, layers, output, name or src.stem)


def load_adapter(path: str | os.PathLike[str], hp: HParams) -> LoraAdapter:
    """An adapter from a GGUF file or a PEFT directory, checked against the base model's hparams."""
    p = Path(path)
    if p.is_dir():
        alpha, tensors = read_peft(p, hp)
        return build_adapter(tensors, alpha, hp, p, p.name)
    g = open_gguf(p)
    meta = g.metadata

    def s(key: str) -> str:
        v = meta.get(key)
        return v if isinstance(v, str) else ""

    if s("general.type") != "adapter":
        raise ModelLoadError(
            f"{p}: general.type is {s('general.type')!r}, not 'adapter'; pass a LoRA adapter (convert_lora_to_gguf.py)"
        )
    if s("adapter.type") != "lora":
        raise ModelLoadError(f"{p}: adapter.type is {s('adapter.type')!r}; only 'lora' adapters are supported")
    if s("general.architecture") != hp.arch:
        raise ModelLoadError(
            f"{p}: the adapter is for {s('general.architecture')!r} but the model is {hp.arch!r}; use the adapter's base model"
        )
    if "adapter.alora.invocation_tokens" in meta:
        raise ModelLoadError(f"{p}: activated LoRA (aLoRA) adapters are not supported")
    a = meta.get("adapter.lora.alpha", 0.0)
    if not isinstance(a, (int, float)) or isinstance(a, bool):
        raise ModelLoadError(f"{p}: adapter.lora.alpha is not a number")
    ad = build_adapter(g.tensors, float(a), hp, p, s("general.name") or p.stem)
    ad.meta = {k: v for k, v in meta.items() if isinstance(v, str)}
    return ad
