"""A loaded model: hyperparameters, vocabulary and weights in their GGUF storage types."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.gguf.file import GGUFFile
from ubatch.engine.gguf.string_array import StringArray
from ubatch.engine.model.arch import TensorSpec, expected_tensors, layer_tensors, model_tensors
from ubatch.engine.model.code_pages import release_startup_code
from ubatch.engine.model.hf.checkpoint import open_model_file
from ubatch.engine.model.hparams import HParams, hparams_from_metadata
from ubatch.engine.vocab.vocab import Vocab
from ubatch.kernels.quant.dequant import UnsupportedTypeError, check_supported
from ubatch.kernels.quant.weight import QWeight

_MATRICES = ("wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down")  # LayerWeights' matrix fields
_OPTIONAL_NORMS = ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")  # present per architecture


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
    for name, (_, shape, required) in expected_tensors(hp).items():
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

        if hp.n_vocab != vocab.n_tokens:
            raise ModelLoadError(f"{src}: vocab_size {hp.n_vocab} differs from {vocab.n_tokens} tokens")

        # check_tensors has checked every name, shape and type the specs below can ask for
        def qweight(spec: TensorSpec) -> QWeight:
            t = g.tensors[spec.name]
            raw = torch.from_numpy(t.data)
            return QWeight(spec.name, raw.to(dev) if dev.type != "cpu" else raw, t.ggml_type, t.shape)

        def vec(spec: TensorSpec) -> torch.Tensor:
            return qweight(spec).dense(torch.float32).to(dev)

        def opt_vec(spec: TensorSpec) -> torch.Tensor | None:
            return vec(spec) if spec.name in g.tensors else None

        layers = []
        for il in range(hp.n_layer):
            t = layer_tensors(hp, il)  # by LayerWeights field
            attn_norm, ffn_norm = vec(t["attn_norm"]), vec(t["ffn_norm"])
            wq, wk, wv, wo, gate, up, down = (qweight(t[f]) for f in _MATRICES)
            q_norm, k_norm, post_attn, post_ffn = (opt_vec(t[f]) for f in _OPTIONAL_NORMS)
            w = (attn_norm, wq, wk, wv, wo, ffn_norm, gate, up, down, q_norm, k_norm, post_attn, post_ffn)
            layers.append(LayerWeights(*w))  # the fields' order
        release_startup_code()  # torch's import-time code pages (engine/model/code_pages.py)
        top = model_tensors(hp)
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
            rope_freqs=opt_vec(top["rope_freqs"]),
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
