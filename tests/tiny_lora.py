"""Tiny random PEFT LoRA adapters over the tiny families' checkpoints (tiny_families.py), saved as
PEFT saves them and converted by llama.cpp's own convert_lora_to_gguf.py.

PEFT initialises B to zero (the adapter starts as the base model); the tests draw A and B with a
seed at a scale that moves the logits clearly, so a wrong scale, a missing pair or a transposed
factor shows in the KLD."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tiny_families
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Several conversions in one interpreter (importing torch, transformers and the converters takes
# most of a conversion's time); the base model's vocabulary read as tiny_families.DRIVER does.
CONVERT = """
import json, runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion.base import TextModel
TextModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
for script, args in json.loads(sys.argv[2]):
    sys.argv = [src + "/" + script, *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_all(jobs: list[tuple[str, list[str], Path]]) -> None:
    """Run llama.cpp's converters (script, arguments, the file it writes) in one process, skipping
    files already written."""
    src = tiny_families.llama_cpp_src()
    assert src is not None
    todo = [(script, args) for script, args, out in jobs if not out.exists()]
    if todo:
        cmd = [sys.executable, "-c", CONVERT, str(src), json.dumps(todo)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]


def base_job(d: Path, out: Path, outtype: str) -> tuple[str, list[str], Path]:
    args = [str(d), "--outfile", str(out), "--outtype", outtype, "--model-name", "tiny"]
    return ("convert_hf_to_gguf.py", args, out)


def lora_job(base_dir: Path, lora_dir: Path, out: Path, outtype: str = "f32") -> tuple[str, list[str], Path]:
    args = ["--base", str(base_dir), "--outfile", str(out), "--outtype", outtype, str(lora_dir)]
    return ("convert_lora_to_gguf.py", args, out)


def peft_model(family: str, seed: int, rank: int = 8, alpha: float = 16.0, targets: list[str] | None = None):  # type: ignore[no-untyped-def]
    """The family's tiny transformers model wrapped by PEFT with seeded random A and B."""
    import peft

    base = tiny_families.hf_model(family)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or TARGETS, lora_dropout=0.0)
    m = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
    return m.eval()


def write_peft(d: Path, family: str, seed: int, rank: int = 8, alpha: float = 16.0) -> Path:
    """The adapter directory: adapter_config.json and adapter_model.safetensors."""
    if not (d / "adapter_config.json").exists():
        peft_model(family, seed, rank, alpha).save_pretrained(d, safe_serialization=True)
    return d


def convert_lora(base_dir: Path, lora_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """lora_dir converted to GGUF by llama.cpp's convert_lora_to_gguf.py against base_dir's config."""
    convert_all([lora_job(base_dir, lora_dir, out, outtype)])
    return out
