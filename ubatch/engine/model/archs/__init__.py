"""The architectures ubatch runs, one module each, found by GGUF name or Hugging Face model_type.

Adding one: a module beside these declaring its `Arch` (archs/base.py), listed in `ARCHS`, and its
tests (tests/test_archs.py); nothing else in the engine names an architecture.
"""

from __future__ import annotations

from ubatch.engine.model.archs import (
    deepseek2,
    gemma2,
    gemma3,
    gpt_oss,
    granite,
    granitemoe,
    llama,
    olmo2,
    olmoe,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    smollm3,
)
from ubatch.engine.model.archs.base import Arch, HParams, Meta, TensorSpec, model_tensors, unknown

ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        llama.ARCH,
        gemma3.ARCH,
        gemma2.ARCH,
        qwen2.ARCH,
        qwen3.ARCH,
        qwen3moe.ARCH,
        gpt_oss.ARCH,
        olmoe.ARCH,
        deepseek2.ARCH,
        qwen2moe.ARCH,
        granitemoe.ARCH,
        granite.ARCH,
        olmo2.ARCH,
        smollm3.ARCH,
        phi3.ARCH,
    )
}
SUPPORTED_ARCHS = tuple(ARCHS)
HF_MODEL_TYPES: dict[str, Arch] = {mt: a for a in ARCHS.values() for mt in a.hf_model_types}


def arch_of(meta: Meta, source: str) -> Arch:
    """The architecture `general.architecture` names, or one line listing those supported."""
    name = meta.get("general.architecture", "")
    if not isinstance(name, str) or name not in ARCHS:
        raise unknown(name, source, SUPPORTED_ARCHS)
    return ARCHS[name]


def layer_specs(hp: HParams, il: int) -> dict[str, TensorSpec]:
    """Layer il's tensors, by the LayerWeights field each one fills."""
    return ARCHS[hp.arch].specs(hp, il)


def expected_tensors(hp: HParams) -> dict[str, TensorSpec]:
    """Every tensor the forward pass reads, by GGUF name: the loader checks a file against it and
    the Hugging Face reader maps and checks the safetensors shards against it, so the two cannot
    disagree on a name or a shape."""
    specs = list(model_tensors(hp).values())
    specs += [t for il in range(hp.n_layer) for t in ARCHS[hp.arch].layer_tensors(hp, il)]
    return {t.name: t for t in specs}
