"""Tensor parallelism's flags, declared once for every command that loads a model (`cli`,
`server`, `bench`, `batched-bench`, `explain`, `info`): `-tp N` (vLLM's --tensor-parallel-size),
and llama.cpp's `-sm row` / `-ts` mapped onto it. `ParallelFlags.load` starts or joins the ranks
(engine/parallel) and returns rank 0's shard of the model; on the other ranks of a torchrun launch
it runs their loop and ends the command when rank 0 stops.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Protocol

import typer

from ubatch.cli.flag_group import flag, flag_group
from ubatch.engine.errors import UbatchError

if TYPE_CHECKING:
    import torch

    from ubatch.engine.context.report import MemoryPlan
    from ubatch.engine.model.model import Model
    from ubatch.engine.params import ContextParams

PANEL = "Tensor parallelism"
_flag = functools.partial(flag, panel=PANEL)
SPLIT_MODES = ("none", "layer", "row")


class Ranks(Protocol):  # engine/parallel/launch.py's, named here without importing torch
    def stop(self) -> None: ...

    def lines(self) -> list[str]: ...


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class ParallelFlags:
    """The flags as typed; `ranks` is the running group once `load` started one."""

    tensor_parallel: int = _flag(
        1,
        "-tp",
        "--tensor-parallel",
        help="ranks each layer is split over (Megatron-style, torch.distributed: gloo between CPU "
        "processes, NCCL between GPUs); started here, or by torchrun (then its world size)",
    )
    split_mode: str = _flag(
        "layer", "-sm", "--split-mode", help="llama.cpp's: row = tensor parallelism over the devices; none, layer: one"
    )
    tensor_split: Optional[str] = _flag(
        None, "-ts", "--tensor-split", help="llama.cpp's device proportions (e.g. 1,1); with -sm row only equal ones"
    )
    tp_timeout: float = _flag(
        60.0, "--tp-timeout", help="seconds the ranks may take to meet, or a rank may stay silent, before the run stops"
    )
    ranks: Optional[Ranks] = field(default=None)  # not a flag: the group `load` started

    def requested(self) -> int | None:
        """The ranks the flags ask for (1: no tensor parallelism; None: -sm row alone, one per
        GPU), every value checked in one line before anything loads."""
        if self.tensor_parallel < 1:
            raise UbatchError(f"-tp {self.tensor_parallel}: the number of ranks must be at least 1")
        if self.tp_timeout <= 0:
            raise UbatchError(f"--tp-timeout {self.tp_timeout:g}: must be a positive number of seconds")
        if self.split_mode not in SPLIT_MODES:
            raise UbatchError(f"-sm {self.split_mode}: invalid value, must be one of: {', '.join(SPLIT_MODES)}")
        n = self.tensor_parallel
        if self.tensor_split is None:
            return None if self.split_mode == "row" and n == 1 else n
        try:
            parts = [float(x) for x in self.tensor_split.replace("/", ",").split(",") if x.strip()]
        except ValueError:
            raise UbatchError(f"-ts {self.tensor_split}: give comma-separated proportions, e.g. 1,1") from None
        parts = [p for p in parts if p > 0] if any(p > 0 for p in parts) else parts
        if self.split_mode != "row":
            raise UbatchError(
                f"-ts {self.tensor_split}: proportions split layers over devices in llama.cpp; ubatch splits "
                "rows: add -sm row (or use -tp N)"
            )
        if len(set(parts)) > 1:
            raise UbatchError(
                f"-ts {self.tensor_split}: unequal proportions cannot be honoured: each rank holds an "
                "equal share of every layer's heads and rows; use equal ones (e.g. 1,1) or -tp N"
            )
        if n not in (1, len(parts)):
            raise UbatchError(f"-ts {self.tensor_split} names {len(parts)} devices but -tp is {n}")
        return len(parts)

    def check(self) -> None:
        """The values, before anything loads."""
        self.requested()

    def world(self, cuda: bool) -> int:
        """The number of ranks: as requested, or with -sm row alone one per CUDA device."""
        n = self.requested()
        if n is not None:
            return n
        if not cuda:
            raise UbatchError("-sm row splits rows over GPUs; on CPUs give the number of ranks with -tp N")
        import torch

        return torch.cuda.device_count()

    @property
    def active(self) -> bool:
        return self.requested() != 1 or under_torchrun()

    def follow(self, device: str | torch.device) -> None:
        """Under torchrun, a rank other than 0 joins the group here, before the command binds a
        port or reads a prompt, does what rank 0 announces, and ends the command when rank 0 stops."""
        if not under_torchrun() or os.environ.get("RANK") == "0":
            return
        import torch

        from ubatch.engine.parallel.launch import launch

        cuda = torch.device(device).type == "cuda"
        n = self.world(cuda)
        launch(None, n if n > 1 else 0, self.tp_timeout, cuda)  # serves rank 0 until it stops
        raise typer.Exit(0)

    def load(self, path: str | Path, device: str | torch.device) -> Model:
        """The model this process computes with: whole, or rank 0's shard with the other ranks
        started (or joined under torchrun, whose other ranks `follow`)."""
        import torch

        from ubatch.engine.model.model import Model

        self.follow(device)
        cuda = torch.device(device).type == "cuda"
        n = self.world(cuda)
        if n == 1 and not under_torchrun():
            return Model.load(path, device)
        from ubatch.engine.parallel.launch import launch

        started = launch(str(path), n if n > 1 else 0, self.tp_timeout, cuda)  # 0: torchrun's world size
        assert started is not None  # the other ranks left in `follow`
        self.ranks, model = started
        return model

    def plan_model(self, model: Model, cuda: bool = False) -> Model:
        """For plans only (`info`): rank 0's cut of a loaded model without starting any rank."""
        n = self.world(cuda)
        if n == 1:
            return model
        from ubatch.engine.model.shard import Shard

        return model.sharded(Shard.for_plan(n, model.hparams.n_vocab))

    def lines(self) -> list[str]:
        """The startup log's lines on the ranks (none without tensor parallelism)."""
        return self.ranks.lines() if self.ranks is not None else []


def ranks_for(model: Model, params: ContextParams, budget: int) -> tuple[int, MemoryPlan]:
    """The fewest ranks whose per-rank plan of `params` fits `budget` bytes, with that plan; a
    rank count the model's heads or blocks do not split into is skipped."""
    from ubatch.engine.context.report import plan_for
    from ubatch.engine.errors import ModelLoadError
    from ubatch.engine.model.shard import Shard

    tried: list[str] = []
    for n in range(1, model.hparams.n_head + 1):
        try:
            m = model if n == 1 else model.sharded(Shard.for_plan(n, model.hparams.n_vocab))
        except ModelLoadError:
            continue
        plan = plan_for(m, params)
        if plan.total_bytes <= budget:
            return n, plan
        tried.append(f"-tp {n}: {plan.total_bytes / 2**20:.1f} MiB")
    raise UbatchError(
        f"-c {params.n_ctx} does not fit {budget / 2**20:.1f} MiB per rank at any rank count this model "
        f"splits into ({'; '.join(tried)}); lower -c, -ub or -np"
    )


# Add the tensor-parallel flags to a command; it receives them as `tp: ParallelFlags`.
parallel_options = flag_group(ParallelFlags, "tp")
