"""SmolLM3: llama's layer, with RoPE left out of every fourth layer (llama.cpp's fixed step; the
Hugging Face config's `no_rope_layer_interval`)."""

from __future__ import annotations

from dataclasses import replace

from ubatch.engine.model.archs import llama
from ubatch.engine.model.archs.base import Arch, HFTable, HParams, Meta, read_core
from ubatch.engine.model.archs.hf_keys import llama3_rope_freqs, llama_keys

NO_ROPE_STEP = 4  # llama.cpp: n_no_rope_layer_step


def read_hparams(meta: Meta, source: str) -> HParams:
    hp = read_core(meta, "smollm3", source)
    return replace(hp, rope_layers=tuple((il + 1) % NO_ROPE_STEP != 0 for il in range(hp.n_layer)))


ARCH = Arch(
    name="smollm3",
    hf_model_types=("smollm3",),
    read_hparams=read_hparams,
    layer_tensors=llama.layer_tensors,
    layer=llama.layer,  # the attention block skips RoPE where the hparams say
    hf=HFTable(llama.HF_LAYER_NAMES, llama_keys, permute_qk=True, extra_tensors=llama3_rope_freqs),
    chat_template="chatml",
)
