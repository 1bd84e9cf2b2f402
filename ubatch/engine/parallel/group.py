"""The ranks of a tensor-parallel run and what they exchange, over torch.distributed.

Two process groups: the compute group carries the graphs' all-reduces and the logits gather
(NCCL between CUDA devices, gloo between CPU processes); the control group (always gloo, on the
host) carries rank 0's messages: which model, which context, which batch, which cell operation.
The other ranks wait for rank 0's next message as long as rank 0 lives, so an idle server's ranks
do not time out; everything else has the fault timeout: a rank that dies or hangs makes rank 0's
next message or collective fail within it, and that failure names the rank (`RankLost`).
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ubatch.engine.context.messages import Decode, DropContext, LoadModel, MemoryOp, Message, NewContext, Stop
from ubatch.engine.errors import EngineDown, TensorParallelError

CONTROL_TIMEOUT = timedelta(days=365)  # waiting for rank 0's next message: an idle server is not a fault


class RankLost(EngineDown):
    """A rank stopped answering: the run cannot go on (the server answers 503 and exits)."""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and how the ranks meet: torchrun's environment, or the address rank 0 chose when it
    started the other ranks itself."""

    rank: int
    world: int
    local_rank: int
    addr: str
    port: int
    timeout_s: float
    cuda: bool
    local_world: int = 0  # ranks on this machine (they share its cores); 0: all of them
    store: str = ""  # a FileStore's file (ranks rank 0 started here); empty: TCP at addr:port

    @property
    def where(self) -> str:
        """Where the ranks meet, for the log and the errors."""
        return f"the file store {self.store}" if self.store else f"{self.addr}:{self.port}"

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    @property
    def device(self) -> str:
        return f"cuda:{self.local_rank}" if self.cuda else "cpu"


def under_torchrun() -> bool:
    """Whether torchrun (or another launcher setting its variables) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def from_torchrun(world: int, timeout_s: float, cuda: bool) -> Rendezvous | None:
    """The rendezvous torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR, ...), or None outside it.
    -tp must agree with the launcher's world size."""
    env = os.environ
    if not under_torchrun():
        return None
    size = int(env["WORLD_SIZE"])
    if world not in (0, size):
        raise TensorParallelError(
            f"-tp {world} but torchrun started {size} processes; pass -tp {size} or leave -tp out"
        )
    return Rendezvous(
        int(env["RANK"]),
        size,
        int(env.get("LOCAL_RANK", env["RANK"])),
        env.get("MASTER_ADDR", "127.0.0.1"),
        int(env.get("MASTER_PORT", "29500")),
        timeout_s,
        cuda,
        int(env.get("LOCAL_WORLD_SIZE", size)),
    )


@dataclass(eq=False)
class TPGroup:
    """One rank's membership: kernels.ops.Collective for the graphs, engine.model.shard.Channel
    for rank 0's messages. `failed` (set by the launcher) names the rank behind a failure."""

    rv: Rendezvous
    control: dist.ProcessGroup
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _released: list[int] = field(default_factory=list)
    _staging: torch.Tensor | None = None
    failed: Callable[[], str] | None = None
    lost: str | None = None  # why the group is gone: no message or collective is tried again

    @property
    def rank(self) -> int:
        return self.rv.rank

    @property
    def world(self) -> int:
        return self.rv.world

    # -- Collective ---------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> None:
        with self._collective("all-reduce"):
            dist.all_reduce(x)

    def gather_cols(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        with self._collective("logits gather"):
            if self.rank != 0:
                dist.gather(x, None, dst=0)
                return
            rows, c = x.shape
            need = self.world * rows * c
            if self._staging is None or self._staging.numel() < need or self._staging.device != x.device:
                self._staging = torch.empty(need, dtype=x.dtype, device=x.device)
            parts = self._staging[:need].view(self.world, rows, c)
            dist.gather(x, list(parts.unbind(0)), dst=0)
            out.copy_(parts.permute(1, 0, 2).reshape(rows, self.world * c)[:, : out.shape[1]])

    @property
    def staging_bytes(self) -> int:
        """Rank 0's buffer for the gathered logits slices (grown to the largest step's outputs)."""
        return 0 if self._staging is None else self._staging.numel() * self._staging.element_size()

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        if self.lost is not None:
            raise RankLost(self.lost)
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            raise RankLost(self._lose(what, e)) from None

    def _lose(self, what: str, e: BaseException) -> str:
        who = self.failed() if self.failed is not None else ""
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        self.lost = (
            f"tensor parallelism: {who or 'a rank'} stopped answering during the {what} ({first}); the run stops"
        )
        return self.lost

    # -- Channel ------------------------------------------------------------------------------
    @contextmanager
    def turn(self) -> Iterator[None]:
        with self._lock:
            yield

    def send(self, msg: object) -> None:
        """Rank 0: broadcast a message (preceded by the drops finalizers queued). Once a rank is
        lost nothing is sent: rank 0 only keeps its own bookkeeping while it winds down."""
        if self.lost is not None:
            return
        with self._lock:
            dropped, self._released[:] = list(self._released), []
            for key in dropped:
                self._broadcast(DropContext(key))
            self._broadcast(msg)

    def release(self, key: int) -> None:
        self._released.append(key)

    def receive(self) -> Message:
        """The other ranks: the next message from rank 0 (waits as long as rank 0 lives)."""
        box: list[object] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except (RuntimeError, dist.DistError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise RankLost(f"tensor parallelism: rank 0 is gone ({first}); rank {self.rank} stops") from None
        msg = box[0]
        if not isinstance(msg, LoadModel | NewContext | Decode | MemoryOp | DropContext | Stop):
            raise RankLost(f"tensor parallelism: rank {self.rank} got {type(msg).__name__} from rank 0, not a message")
        return msg

    def _broadcast(self, msg: object) -> None:
        try:
            dist.broadcast_object_list([msg], src=0, group=self.control)
        except (RuntimeError, dist.DistError, pickle.PicklingError) as e:
            raise RankLost(self._lose("message broadcast", e)) from None


def join(rv: Rendezvous) -> TPGroup:
    """Join the ranks (every rank calls it); a rendezvous that does not complete within the
    timeout is one line naming where it waited."""
    if rv.cuda:
        torch.cuda.set_device(rv.local_rank)
    # torch's TCP rendezvous store listens on every interface, whatever address it is given: ranks
    # started on this machine meet through a file in a private folder instead, so nothing but
    # torchrun's own rendezvous (which the user configured) ever opens a port beyond loopback
    try:
        store = dist.FileStore(rv.store, rv.world) if rv.store else None
        dist.init_process_group(
            rv.backend,
            init_method=None if store is not None else f"tcp://{rv.addr}:{rv.port}",
            store=store,
            rank=rv.rank,
            world_size=rv.world,
            timeout=timedelta(seconds=rv.timeout_s),
        )
        # each process sets its own side's timeout: rank 0's messages must arrive within the
        # fault timeout; the others wait for the next one as long as rank 0 lives
        control = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=rv.timeout_s) if rv.rank == 0 else CONTROL_TIMEOUT
        )
    except (RuntimeError, dist.DistError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise TensorParallelError(
            f"tensor parallelism: rank {rv.rank} of {rv.world} could not meet the others at "
            f"{rv.where} within {rv.timeout_s:g} s ({first}); check that every rank was started "
            f"with the same --rdzv-endpoint / MASTER_ADDR and that the port is reachable"
        ) from None
    assert control is not None
    return TPGroup(rv, control)


def leave() -> None:
    """Leave the process group (each rank, at the end of the run)."""
    if dist.is_initialized():
        dist.destroy_process_group()
