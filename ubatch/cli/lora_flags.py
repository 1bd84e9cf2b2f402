"""llama.cpp's LoRA flags, declared once for `ubatch cli` and `ubatch server`: `--lora FNAME`
(comma-separated, repeatable) at scale 1, `--lora-scaled FNAME:SCALE,...`, and the server's
`--lora-init-without-apply` (loaded at scale 0, applied later by POST /lora-adapters). The files
are checked before the model loads; `load` reads them against the model and sets the context's
scales as llama.cpp's common_init_from_params does."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ubatch.cli.flag_group import flag, flag_group
from ubatch.engine.errors import UbatchError

if TYPE_CHECKING:
    from ubatch.engine.model.model import Model

PANEL = "LoRA adapters"
_flag = functools.partial(flag, panel=PANEL)


@dataclass
class LoraFlags:
    lora: Optional[list[str]] = _flag(
        None, "--lora", help="LoRA adapter: a GGUF file or a PEFT directory (comma-separated or repeated for several)"
    )
    lora_scaled: Optional[list[str]] = _flag(
        None, "--lora-scaled", help="LoRA adapter with its own scale: FNAME:SCALE (comma-separated or repeated)"
    )
    lora_init_without_apply: bool = _flag(
        False, "--lora-init-without-apply", help="load the adapters at scale 0 (apply later via POST /lora-adapters)"
    )

    def adapters(self) -> list[tuple[Path, float]]:
        """(path, scale) in the order given: --lora's first, then --lora-scaled's, as llama.cpp
        appends them (each flag's values in order). Checked: files exist, scales are numbers."""
        out = [(Path(p.strip()), 1.0) for v in self.lora or [] for p in v.split(",") if p.strip()]
        for v in self.lora_scaled or []:
            for item in (i for i in v.split(",") if i.strip()):
                path, sep, scale = item.strip().rpartition(":")
                try:
                    out.append((Path(path), float(scale)))
                except ValueError:
                    sep = ""
                if not sep or not path:
                    raise UbatchError(
                        f"--lora-scaled {item}: the format is FNAME:SCALE (e.g. adapter.gguf:0.5; "
                        "llama.cpp's older two-argument form FNAME SCALE is written FNAME:SCALE)"
                    )
        for p, _ in out:
            if not p.exists():
                raise UbatchError(f"LoRA adapter not found: {p}; give the path of a GGUF adapter or a PEFT directory")
        return out

    def check(self) -> list[tuple[Path, float]]:
        return self.adapters()

    def load(self, model: Model) -> dict[int, float]:
        """Load the adapters for the model (before its context, which reserves room for them);
        the scales the context applies (all 0 with --lora-init-without-apply)."""
        scales = {}
        for path, scale in self.adapters():
            scales[model.load_adapter(path)] = 0.0 if self.lora_init_without_apply else scale
        return scales


def _is_scale(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def join_two_argument_form(words: list[str]) -> list[str]:
    """`--lora-scaled FNAME SCALE` (llama.cpp's older two-argument form, the one its docs still
    show) as today's `--lora-scaled FNAME:SCALE`: where FNAME ends in no scale of its own and the
    word after it is a number."""
    out: list[str] = []
    i = 0
    while i < len(words):
        if words[i] == "--lora-scaled" and i + 2 < len(words):
            fname, scale = words[i + 1], words[i + 2]
            if _is_scale(scale) and not _is_scale(fname.rpartition(":")[2]):
                out += ["--lora-scaled", f"{fname}:{scale}"]
                i += 3
                continue
        out.append(words[i])
        i += 1
    return out


# Add the LoRA flags to a command; it receives them as `lora: LoraFlags`.
lora_options = flag_group(LoraFlags, "lora")
lora_options_cli = flag_group(LoraFlags, "lora", omit=("lora_init_without_apply",))
