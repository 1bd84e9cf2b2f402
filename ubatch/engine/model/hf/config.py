"""A Hugging Face `config.json` written as the GGUF keys llama.cpp's converter writes for it.

The keys go into a path-less `gguf.GGUFWriter` through the same `add_*` calls the converter
makes, so a checkpoint's metadata has the converter's names and value types, and `ubatch
convert` copies exactly those keys into the file it writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from ubatch.engine.errors import ModelLoadError
from ubatch.engine.model.archs import ARCHS, HF_MODEL_TYPES
from ubatch.engine.model.archs.base import Config


def read_config(d: Path) -> tuple[str, Config]:
    """(GGUF arch, the text model's config) of checkpoint directory d, or one line saying why not."""
    f = d / "config.json"
    if not f.is_file():
        raise ModelLoadError(
            f"{d}: no config.json; a Hugging Face checkpoint directory needs one (or pass a .gguf file)"
        )
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{f}: expected a JSON object")
    mt = cfg.get("model_type")
    wrapped = {w: inner for a in ARCHS.values() for w, inner in a.hf.text_config.items()}
    if isinstance(mt, str) and mt in wrapped:  # e.g. Gemma3ForConditionalGeneration: its text model only
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError(f"{f}: model_type {mt!r} without a text_config object; the config is incomplete")
        cfg, mt = {**cfg, **text}, wrapped[mt]
    if not isinstance(mt, str) or mt not in HF_MODEL_TYPES:
        raise ModelLoadError(
            f"{f}: model_type {mt!r} is not supported; ubatch runs Hugging Face checkpoints of {', '.join(HF_MODEL_TYPES)}"
        )
    if HF_MODEL_TYPES[mt].hf.refused:
        raise ModelLoadError(f"{f}: model_type {mt!r}: {HF_MODEL_TYPES[mt].hf.refused}")
    return HF_MODEL_TYPES[mt].name, cfg


def write_hparams(w: gguf.GGUFWriter, arch: str, cfg: Config, src: str) -> None:
    """The architecture keys, as the converter's model class for it sets them (engine/model/archs)."""
    ARCHS[arch].hf.write_hparams(w, cfg, src)
