"""A loaded model: hyperparameters, vocabulary and weights in their GGUF storage types."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.file import GGUFFile
from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.model.archs import ARCHS, expected_tensors, layer_specs
from ubatch.engine.model.archs.base import TensorSpec, model_tensors
from ubatch.engine.model.code_pages import populate, release_startup_code
from ubatch.engine.model.hf.checkpoint import open_model_file
from ubatch.engine.model.hparams import HParams, hparams_from_metadata
from ubatch.engine.model.lora import LoraAdapter, load_adapter, stack_adapters
from ubatch.engine.model.shard import Cutter, Shard, check_split, head_split, row_slice, vocab_slice
from ubatch.engine.vocab.vocab import Vocab
from ubatch.kernels.ops import LoraStack
from ubatch.kernels.quant.dequant import UnsupportedTypeError, check_supported
from ubatch.kernels.quant.weight import QWeight


@dataclass(slots=True)
class LayerWeights:
    """One layer's weights by their `TensorSpec.field` (engine/model/archs): matrices kept in their
    GGUF storage type, norm weights and biases as f32 tensors. A field the layer lacks is absent."""

    mats: dict[str, QWeight]
    vecs: dict[str, torch.Tensor]

    def __getattr__(self, field: str) -> QWeight | torch.Tensor | None:
        """`L.wq`, `L.q_norm`: a weight by its field; None for an optional one the layer lacks."""
        if field in ("mats", "vecs"):  # not yet set (copying, unpickling)
            raise AttributeError(field)
        return self.mats.get(field) if field in self.mats else self.vecs.get(field)

    def mat(self, field: str) -> QWeight:
        return self.mats[field]

    def vec(self, field: str) -> torch.Tensor | None:
        return self.vecs.get(field)


def fused_parts(w: QWeight, spec: TensorSpec) -> dict[str, QWeight]:
    """A fused tensor's parts (Q, K, V or gate, up) as views of its rows, each still as stored."""
    out, r0 = {}, 0
    for field, rows, _ in spec.parts:
        v = row_slice(w, r0, r0 + rows)
        out[field] = QWeight(f"{spec.name}[{field}]", v.raw, v.ggml_type, v.shape)
        r0 += rows
    return out


def _stored_rope_freqs(freqs: torch.Tensor | None, hp: HParams, dev: torch.device, src: str) -> torch.Tensor | None:
    """The frequency divisors fixed at load: the file's rope_freqs (llama3) or yarn's factors from
    the hparams. Model.rope_factors then picks, per context, these or LongRoPE's long/short pair."""
    if not hp.rope_yarn_factors:
        return freqs
    if freqs is not None:
        raise ModelLoadError(f"{src}: both rope_freqs.weight and yarn rope scaling; only one is supported")
    return torch.tensor(hp.rope_yarn_factors, dtype=torch.float32, device=dev)


def _outer_ones_stripped(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape as ggml compares it: its outer dimensions of 1 dropped (llama-quantize writes
    qwen2moe's (1, n_embd) shared-expert gate as (n_embd,))."""
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


def check_tensors(g: GGUFFile, hp: HParams, src: str) -> None:
    """The tensor table against the hparams, before any tensor is made: counts, names, shapes, types."""
    a = hp.arch
    layers = {int(n.split(".")[1]) for n in g.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    n_present = max(layers) + 1 if layers else 0
    if n_present != hp.n_layer:
        raise ModelLoadError(
            f"{src}: metadata {a}.block_count = {hp.n_layer} but the file has tensors for {n_present} layers; the file is corrupt"
        )
    expected = expected_tensors(hp)
    for name in g.tensors:  # fused tensors where the architecture (as in llama.cpp) reads only the parts
        if name.endswith((".attn_qkv.weight", ".ffn_gate_up_exps.weight")) and name not in expected:
            raise ModelLoadError(
                f"{src}: fused {name.split('.')[-2]} tensors are not supported for {a}, as in llama.cpp"
            )
    for name, why in ARCHS[a].refused:
        if name in g.tensors:
            raise ModelLoadError(f"{src}: tensor {name!r}: {why}")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, (list, StringArray)) and len(tokens) != hp.n_vocab:
        raise ModelLoadError(f"{src}: metadata {a}.vocab_size = {hp.n_vocab} differs from {len(tokens)} tokens")
    # a tensor some files hold in place of others (experts' gate and up as one): then not those
    stood_in: set[str] = set()
    for il in range(hp.n_layer):
        specs = layer_specs(hp, il)
        for spec in (s for s in specs.values() if s.instead_of and s.name in g.tensors):
            for other in (specs[f].name for f in spec.instead_of):
                if other in g.tensors:
                    raise ModelLoadError(f"{src}: tensors {spec.name!r} and {other!r}: a file holds one or the other")
                stood_in.add(other)
    for name, spec in expected.items():
        shape, t = spec.shape, g.tensors.get(name)
        if t is None:
            if spec.required and name not in stood_in:
                raise ModelLoadError(f"{src}: tensor {name!r} is missing; the file is incomplete or not {a}")
            continue
        if t.shape != shape and _outer_ones_stripped(t.shape) != _outer_ones_stripped(shape):
            raise ModelLoadError(f"{src}: tensor {name!r} has shape {t.shape}, expected {shape} from the metadata")
        try:
            check_supported(t.ggml_type, f"{src}: tensor {name!r}")
        except UnsupportedTypeError as e:
            raise ModelLoadError(str(e)) from None


@dataclass(slots=True)
class Model:
    path: Path
    gguf: GGUFFile
    hparams: HParams
    vocab: Vocab
    tok_embd: QWeight
    output: QWeight  # token_embd itself when the output is tied
    output_norm: torch.Tensor
    layers: list[LayerWeights]
    rope_freqs: torch.Tensor | None
    device: torch.device
    load_ms: float
    shard: Shard | None = None  # tensor parallelism: the part of the model this rank holds
    whole: HParams | None = None  # with a shard: the model's own hparams (`hparams` are one rank's)
    rope_long: torch.Tensor | None = None  # LongRoPE (phi3 128k): per-pair divisors for long contexts
    rope_short: torch.Tensor | None = None  # ... and for contexts within the original length
    # LoRA adapters loaded for this model (llama_adapter_lora_init): contexts apply them by index
    adapters: list[LoraAdapter] = dataclasses.field(default_factory=list)
    # their pairs stacked per targeted matrix for the segmented kernels (lora.py `stack_adapters`)
    lora_stacks: dict[tuple[int, str], LoraStack] = dataclasses.field(default_factory=dict)

    def load_adapter(self, path: str | os.PathLike[str]) -> int:
        """Load a LoRA adapter for this model (checked against it); its index in `adapters`."""
        if self.shard is not None:
            raise ModelLoadError(f"{path}: LoRA adapters are not supported with -tp; run without -tp")
        self.adapters.append(load_adapter(path, self.hparams))
        self.lora_stacks = stack_adapters(self.adapters, self.device)
        return len(self.adapters) - 1

    @property
    def adapter_bytes(self) -> int:
        return sum(a.nbytes for a in self.adapters)

    def rope_factors(self, n_ctx_seq: int) -> torch.Tensor | None:
        """The per-pair frequency divisors of a context with n_ctx_seq cells per sequence:
        rope_freqs (llama3's tensor, yarn's factors), else LongRoPE's long factors where n_ctx_seq
        exceeds the original context and its short ones within it (llama.cpp's rule: fixed for
        the context, whatever length a prompt has)."""
        if self.rope_freqs is not None or self.rope_long is None:
            return self.rope_freqs
        return self.rope_long if n_ctx_seq > self.hparams.n_ctx_orig else self.rope_short

    @property
    def n_params(self) -> int:
        """The weights this process holds, counted in values (one rank's cut with a shard)."""
        if self.shard is None:
            return sum(int(np.prod(t.shape)) for t in self.gguf.tensors.values())
        vecs = [self.output_norm, *(v for L in self.layers for v in L.vecs.values())]
        held = {w.raw.data_ptr(): int(np.prod(w.shape)) for w in self.matrices()}
        return sum(held.values()) + sum(v.numel() for v in vecs)

    @property
    def size_bytes(self) -> int:
        """The weights this process holds: the file's tensors, or one rank's cut of them."""
        if self.shard is None:
            return sum(t.n_bytes for t in self.gguf.tensors.values())
        vecs = [self.output_norm, *(v for L in self.layers for v in L.vecs.values())]
        held = {w.raw.data_ptr(): w.nbytes for w in self.matrices()}  # a tied head is a view of the embedding
        return sum(held.values()) + sum(v.numel() * v.element_size() for v in vecs)

    @property
    def active_bytes(self) -> int:
        """The weights one token's forward reads: all of them (`size_bytes`), but of a mixture of
        experts' 3-D expert tensors only the share of the experts a token chooses."""
        moe = self.hparams.moe
        if moe is None:
            return self.size_bytes
        eb = sum(w.nbytes for L in self.layers for f, w in L.mats.items() if f.endswith("_exps"))
        return self.size_bytes - eb + round(eb * moe.n_expert_used / moe.n_expert)

    @property
    def name(self) -> str:
        return str(self.gguf.metadata.get("general.name", self.path.stem))

    @classmethod
    def load(cls, path: str | os.PathLike[str], device: str | torch.device = "cpu") -> Model:
        t0 = time.perf_counter()
        g = open_model_file(path)  # a GGUF file, or a Hugging Face checkpoint directory
        src = str(g.path)
        hp = hparams_from_metadata(g.metadata, src)
        vocab = Vocab.from_metadata(g.metadata, src)
        check_tensors(g, hp, src)
        dev = torch.device(device)

        if hp.n_vocab != vocab.n_tokens:
            raise ModelLoadError(f"{src}: vocab_size {hp.n_vocab} differs from {vocab.n_tokens} tokens")

        # check_tensors has checked every name, shape and type the specs below can ask for
        def qweight(spec: TensorSpec) -> QWeight:
            t = g.tensors[spec.name]
            raw = torch.from_numpy(t.data)
            # the declared shape: equal to the file's but for outer 1s, which ggml does not keep
            return QWeight(spec.name, raw.to(dev) if dev.type != "cpu" else raw, t.ggml_type, spec.shape)

        def vec(spec: TensorSpec) -> torch.Tensor:
            return qweight(spec).dense(torch.float32).to(dev)

        def opt_vec(spec: TensorSpec) -> torch.Tensor | None:
            return vec(spec) if spec.name in g.tensors else None

        layers = []
        for il in range(hp.n_layer):  # one loop over the architecture's declared tensors
            specs = [t for t in layer_specs(hp, il).values() if t.name in g.tensors]
            mats = {t.field: qweight(t) for t in specs if t.stored_as_matrix and not t.parts}
            for t in (t for t in specs if t.parts):  # a fused tensor: each part a view of its rows
                mats |= fused_parts(qweight(t), t)
            for w in mats.values():
                if len(w.shape) == 3:  # experts: read at random, each first use a fault a page
                    populate(w.raw)
            layers.append(LayerWeights(mats, {t.field: vec(t) for t in specs if not t.stored_as_matrix}))
        release_startup_code()  # torch's import-time code pages (engine/model/code_pages.py)
        top = model_tensors(hp)
        longrope = opt_vec(top["rope_long"])
        if (longrope is None) != (top["rope_short"].name not in g.tensors):
            raise ModelLoadError(
                f"{src}: LongRoPE needs both rope_factors_long and rope_factors_short; the file is corrupt"
            )
        if longrope is not None and (top["rope_freqs"].name in g.tensors or hp.rope_yarn_factors):
            raise ModelLoadError(f"{src}: both LongRoPE factors and rope_freqs/yarn scaling; only one is supported")
        tok_embd = qweight(top["tok_embd"])
        output = qweight(top["output"]) if top["output"].name in g.tensors else tok_embd
        return cls(
            path=g.path,
            gguf=g,
            hparams=hp,
            vocab=vocab,
            tok_embd=tok_embd,
            output=output,
            output_norm=vec(top["output_norm"]),
            layers=layers,
            rope_freqs=_stored_rope_freqs(opt_vec(top["rope_freqs"]), hp, dev, src),
            device=dev,
            load_ms=(time.perf_counter() - t0) * 1e3,
            rope_long=longrope,
            rope_short=opt_vec(top["rope_short"]) if longrope is not None else None,
        )

    def sharded(self, shard: Shard, device: str | torch.device | None = None) -> Model:
        """This model as rank `shard.rank` of `shard.world` holds it (engine/model/shard.py): the
        heads, FFN rows and vocabulary slice it computes, and hparams that say so, so its KV
        cache, graphs and memory plan are one rank's. Refused in one line where the shapes or the
        quantisation blocks do not split. `device`: where the cut goes (load the model on the CPU,
        where row cuts are views of the mapped file, then move only this rank's part)."""
        hp, r, w = self.hparams, shard.rank, shard.world
        dev = torch.device(device) if device is not None else self.device
        src = str(self.path)
        check_split(hp.n_head, hp.n_head_kv, hp.n_ff, w, src)
        whole = [t.name for t in layer_specs(hp, 0).values() if t.cut == "none"] if hp.n_layer else []
        if whole:
            raise ModelLoadError(
                f"{src}: {hp.arch}'s {', '.join(whole)} span every attention head, which ranks holding some heads "
                "cannot compute; run it without -tp"
            )
        split = head_split(hp.n_head, hp.n_head_kv, r, w)
        moe = hp.moe
        for what, n in (
            (("expert_feed_forward_length", moe.n_ff_exp), ("the shared experts' width", moe.n_ff_shexp)) if moe else ()
        ):
            if n % w:
                raise ModelLoadError(f"{src}: {what} {n} does not split over {w} ranks; use a -tp that divides {n}")
        n_ff_exp, n_ff_shexp = (moe.n_ff_exp, moe.n_ff_shexp) if moe else (0, 0)
        # a query head's widths: latent attention's own (its cache row is every head's, kept whole)
        dk, dv = (hp.mla.n_embd_head_k, hp.mla.n_embd_head_v) if hp.mla else (hp.n_embd_head_k, hp.n_embd_head_v)
        cutter = Cutter(split, dk, dv, hp.n_ff, r, w, n_ff_exp, n_ff_shexp)
        layers = []
        for il, L in enumerate(self.layers):  # each tensor as its spec says tensor parallelism cuts it
            cuts = ARCHS[hp.arch].cuts(hp, il)
            mats = {f: cutter.matrix(cuts[f], m) for f, m in L.mats.items()}
            layers.append(LayerWeights(mats, {f: cutter.vector(cuts[f], v) for f, v in L.vecs.items()}))
        # one zero row past the slice: where the ids other ranks hold look up (Shard.local_tokens)
        tok_embd = vocab_slice(self.tok_embd, shard.vocab_lo, shard.vocab_rows, 1)
        if self.output is self.tok_embd:  # tied: the head is the slice without its zero row
            output = QWeight(tok_embd.name, tok_embd.raw[: shard.vocab_rows * tok_embd.row_bytes], tok_embd.ggml_type,
                             (shard.vocab_rows, hp.n_embd))  # fmt: skip
        else:
            output = vocab_slice(self.output, shard.vocab_lo, shard.vocab_rows, 0)
        cut = replace(
            self,
            hparams=replace(
                hp,
                n_head=split.n_q,
                n_head_kv=split.n_kv,
                n_ff=hp.n_ff // w,
                moe=replace(moe, n_ff_exp=moe.n_ff_exp // w) if moe else None,
            ),
            tok_embd=tok_embd,
            output=output,
            layers=layers,
            shard=shard,
            whole=hp,
        )
        return cut if dev == self.device else cut._moved(dev)

    def _moved(self, dev: torch.device) -> Model:
        """This model's tensors on `dev` (a tied head stays a view of the moved embedding)."""

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dev)

        def q(w: QWeight) -> QWeight:
            return w.to(dev)

        tok = q(self.tok_embd)
        tied = self.output.raw.data_ptr() == self.tok_embd.raw.data_ptr()
        out = (
            QWeight(tok.name, tok.raw[: self.output.nbytes], tok.ggml_type, self.output.shape)
            if tied
            else q(self.output)
        )
        layers = [
            LayerWeights({f: q(m) for f, m in L.mats.items()}, {f: v.to(dev) for f, v in L.vecs.items()})
            for L in self.layers
        ]
        return replace(
            self,
            tok_embd=tok,
            output=out,
            output_norm=self.output_norm.to(dev),
            layers=layers,
            rope_freqs=mv(self.rope_freqs),
            rope_long=mv(self.rope_long),
            rope_short=mv(self.rope_short),
            device=dev,
        )

    def matrices(self) -> list[QWeight]:
        """Every matrix the forward pass multiplies with (tied output counted once)."""
        ws = [w for L in self.layers for w in L.mats.values()]
        ws.append(self.output)
        if self.tok_embd is not self.output:
            ws.append(self.tok_embd)
        return ws
