"""`--device cuda|cpu|auto`: where the model runs, as a torch device plus the op backend for it.

auto (the default) takes the GPU when torch sees one. On the GPU the weights, the KV cache and
the compute buffer live in device memory and the `cuda` backend's Triton kernels compute;
on the CPU the `--backend` flag chooses as before. llama.cpp's spellings are accepted too
(`-dev none` = cpu, `CUDA0` = cuda). Errors are one line (the CLI exits 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ubatch.cli.common import watch_kernel_builds
from ubatch.engine.errors import UbatchError

if TYPE_CHECKING:
    import torch

    from ubatch.engine.model.model import Model

DEVICES = ("auto", "cuda", "cpu")
_ALIASES = {"none": "cpu", "cuda0": "cuda", "gpu": "cuda"}


class DeviceError(UbatchError):
    """--device names a device this machine does not have, or one the --backend cannot use."""


def resolve_device(flag: str = "auto", backend: str = "auto") -> tuple[torch.device, str]:
    """(the torch device the model is loaded on, the op backend name) for `--device` and
    `--backend`; raises DeviceError with the one line to print. Every command that loads a model
    calls this first, so here a cold kernel build is set to show itself (`watch_kernel_builds`)."""
    want = _ALIASES.get(flag.strip().lower(), flag.strip().lower())
    if want not in DEVICES:
        raise DeviceError(f"--device {flag}: unknown device; use cuda, cpu or auto")
    import torch  # after the name check: a typo answers before torch loads

    watch_kernel_builds()
    gpu = torch.cuda.is_available()
    if want == "auto":
        want = "cuda" if gpu and backend in ("auto", "cuda") else "cpu"
    if want == "cuda":
        if not gpu:
            raise DeviceError(
                "--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False); use --device cpu"
            )
        if backend not in ("auto", "cuda"):
            raise DeviceError(f"--device cuda: --backend {backend} computes on the CPU; use --backend cuda or auto")
        return torch.device("cuda", 0), "cuda"
    if backend == "cuda" and gpu:
        raise DeviceError("--backend cuda computes on the GPU: use --device cuda (or auto)")
    return torch.device("cpu"), backend


def device_name(device: torch.device | str) -> str:
    """llama.cpp's buffer name for a device: CUDA0, CPU (the startup log's column)."""
    import torch

    d = torch.device(device)
    return f"CUDA{d.index or 0}" if d.type == "cuda" else "CPU"


def describe(device: torch.device | str) -> str:
    """One line for the startup log: the GPU's name and memory, or 'CPU'."""
    import torch

    d = torch.device(device)
    if d.type != "cuda":
        return "CPU"
    p = torch.cuda.get_device_properties(d)
    return f"{device_name(d)}: {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB"


def load_on(paths: list[Path], device: torch.device) -> dict[Path, Model] | None:
    """The models loaded into `device`'s memory, or None on the CPU (the commands load them there
    themselves, as before)."""
    if device.type == "cpu":
        return None
    from ubatch.engine.model.model import Model

    return {p: Model.load(p, device) for p in paths}
