"""A loaded model: hyperparameters, vocabulary and weights in their GGUF storage types."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.file import GGUFFile, TensorInfo
from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.model.code_pages import release_startup_code
from ubatch.engine.model.hf.checkpoint import open_model_file
from ubatch.engine.model.hparams import HParams, hparams_from_metadata
from ubatch.engine.vocab.vocab import Vocab
from ubatch.kernels.quant.dequant import UnsupportedTypeError, check_supported
from ubatch.kernels.quant.weight import QWeight


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor
    wq: QWeight
    wk: QWeight
    wv: QWeight
    wo: QWeight
    ffn_norm: torch.Tensor
    ffn_gate: QWeight
    ffn_up: QWeight
    ffn_down: QWeight
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None


def expected_tensors(hp: HParams) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every tensor the forward pass reads: name -> (shape the hparams imply, required)."""
    d, dk, dv, v = hp.n_embd, hp.n_embd_head_k, hp.n_embd_head_v, hp.n_vocab
    out = {
        "token_embd.weight": ((v, d), True),
        "output.weight": ((v, d), False),
        "output_norm.weight": ((d,), True),
        "rope_freqs.weight": ((hp.n_rot // 2,), False),
    }
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        out |= {
            p + "attn_norm.weight": ((d,), True),
            p + "attn_q.weight": ((hp.n_head * dk, d), True),
            p + "attn_k.weight": ((hp.n_head_kv * dk, d), True),
            p + "attn_v.weight": ((hp.n_head_kv * dv, d), True),
            p + "attn_output.weight": ((d, hp.n_head * dv), True),
            p + "ffn_norm.weight": ((d,), True),
            p + "ffn_gate.weight": ((hp.n_ff, d), True),
            p + "ffn_up.weight": ((hp.n_ff, d), True),
            p + "ffn_down.weight": ((d, hp.n_ff), True),
            p + "attn_q_norm.weight": ((dk,), hp.qk_norm),
            p + "attn_k_norm.weight": ((dk,), hp.qk_norm),
            p + "post_attention_norm.weight": ((d,), hp.sandwich_norm),
            p + "post_ffw_norm.weight": ((d,), hp.sandwich_norm),
        }
    return out


def check_tensors(g: GGUFFile, hp: HParams, src: str) -> None:
    """The tensor table against the hparams, before any tensor is made: counts, names, shapes, types."""
    a = hp.arch
    layers = {int(n.split(".")[1]) for n in g.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    n_present = max(layers) + 1 if layers else 0
    if n_present != hp.n_layer:
        raise ModelLoadError(
            f"{src}: metadata {a}.block_count = {hp.n_layer} but the file has tensors for {n_present} layers; the file is corrupt"
        )
    if "blk.0.attn_qkv.weight" in g.tensors:
        raise ModelLoadError(f"{src}: fused attn_qkv tensors are not supported")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, (list, StringArray)) and len(tokens) != hp.n_vocab:
        raise ModelLoadError(f"{src}: metadata {a}.vocab_size = {hp.n_vocab} differs from {len(tokens)} tokens")
    for name, (shape, required) in expected_tensors(hp).items():
        t = g.tensors.get(name)
        if t is None:
            if required:
                raise ModelLoadError(f"{src}: tensor {name!r} is missing; the file is incomplete or not {a}")
            continue
        if t.shape != shape:
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

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.gguf.tensors.values())

    @property
    def size_bytes(self) -> int:
        return sum(t.n_bytes for t in self.gguf.tensors.values())

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

        def info(name: str) -> TensorInfo | None:
            return g.tensors.get(name)

        def qweight(name: str, shape: tuple[int, ...] | None = None) -> QWeight:
            t = info(name)
            if t is None:
                raise ModelLoadError(f"{src}: tensor {name!r} is missing; the file is incomplete or not {hp.arch}")
            if shape is not None and t.shape != shape:
                raise ModelLoadError(f"{src}: tensor {name!r} has shape {t.shape}, expected {shape}")
            try:
                check_supported(t.ggml_type, f"{src}: tensor {name!r}")
            except UnsupportedTypeError as e:
                raise ModelLoadError(str(e)) from None
            raw = torch.from_numpy(t.data)
            return QWeight(name, raw.to(dev) if dev.type != "cpu" else raw, t.ggml_type, t.shape)

        def vec(name: str, n: int, required: bool = True) -> torch.Tensor | None:
            if info(name) is None and not required:
                return None
            return qweight(name, (n,)).dense(torch.float32).to(dev)

        if hp.n_vocab != vocab.n_tokens:
            hp_vocab = hp.n_vocab
            raise ModelLoadError(f"{src}: vocab_size {hp_vocab} differs from {vocab.n_tokens} tokens")
        d, dk, dv = hp.n_embd, hp.n_embd_head_k, hp.n_embd_head_v
        layers = []
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            layers.append(
                LayerWeights(
                    attn_norm=vec(p + "attn_norm.weight", d),
                    wq=qweight(p + "attn_q.weight", (hp.n_head * dk, d)),
                    wk=qweight(p + "attn_k.weight", (hp.n_head_kv * dk, d)),
                    wv=qweight(p + "attn_v.weight", (hp.n_head_kv * dv, d)),
                    wo=qweight(p + "attn_output.weight", (d, hp.n_head * dv)),
                    ffn_norm=vec(p + "ffn_norm.weight", d),
                    ffn_gate=qweight(p + "ffn_gate.weight", (hp.n_ff, d)),
                    ffn_up=qweight(p + "ffn_up.weight", (hp.n_ff, d)),
                    ffn_down=qweight(p + "ffn_down.weight", (d, hp.n_ff)),
                    q_norm=vec(p + "attn_q_norm.weight", dk, required=hp.qk_norm),
                    k_norm=vec(p + "attn_k_norm.weight", dk, required=hp.qk_norm),
                    post_attn_norm=vec(p + "post_attention_norm.weight", d, required=hp.sandwich_norm),
                    post_ffn_norm=vec(p + "post_ffw_norm.weight", d, required=hp.sandwich_norm),
                )
            )
        release_startup_code()  # torch's import-time code pages (engine/code_pages.py)
        tok_embd = qweight("token_embd.weight", (hp.n_vocab, d))
        output = qweight("output.weight", (hp.n_vocab, d)) if "output.weight" in g.tensors else tok_embd
        return cls(
            path=g.path,
            gguf=g,
            hparams=hp,
            vocab=vocab,
            tok_embd=tok_embd,
            output=output,
            output_norm=vec("output_norm.weight", d),
            layers=layers,
            rope_freqs=vec("rope_freqs.weight", hp.n_rot // 2, required=False),
            device=dev,
            load_ms=(time.perf_counter() - t0) * 1e3,
        )

    def matrices(self) -> list[QWeight]:
        """Every matrix the forward pass multiplies with (tied output counted once)."""
        ws = [w for L in self.layers for w in (L.wq, L.wk, L.wv, L.wo, L.ffn_gate, L.ffn_up, L.ffn_down)]
        ws.append(self.output)
        if self.tok_embd is not self.output:
            ws.append(self.tok_embd)
        return ws
