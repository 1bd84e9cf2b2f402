"""Starting the ranks: under torchrun every process is started by the launcher and joins from
its environment; otherwise rank 0 (this process) starts ranks 1..N-1 itself on this machine
(torch.multiprocessing, spawned), and stops them when it ends.

Ranks started here expose nothing to the network: they meet through a file store in a folder only
this user can read (torch's TCP store would listen on every interface), and gloo's and NCCL's
sockets are bound to the loopback interface. Under torchrun the rendezvous is the one the user
configured (`--rdzv-endpoint` / MASTER_ADDR:MASTER_PORT), and torch's store listens there."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from ubatch.engine.context.messages import Stop
from ubatch.engine.errors import TensorParallelError, UbatchError
from ubatch.engine.model.model import Model
from ubatch.engine.parallel.group import Rendezvous, TPGroup, from_torchrun, join, leave
from ubatch.engine.parallel.worker import Worker, load_shard

DEFAULT_TIMEOUT_S = 60.0  # a collective or a rendezvous that waits longer is a fault


@dataclass(eq=False)
class Ranks:
    """The group of a run, seen from one process: rank 0 stops the others at the end."""

    group: TPGroup
    procs: list[BaseProcess] = field(default_factory=list)
    stopped: bool = False
    private_dir: str = ""  # the store's folder (ranks started here), removed at the end

    @property
    def rank(self) -> int:
        return self.group.rank

    def serve(self) -> None:
        """Ranks 1..N-1 (torchrun): follow rank 0 until it stops, then leave."""
        try:
            Worker(self.group, self.group.rv.device if self.group.rv.cuda else "cpu").run()
        finally:
            leave()

    def lines(self) -> list[str]:
        """The startup log's word on the ranks: how they meet and which process each one is."""
        rv = self.group.rv
        head = f"ubatch: tensor parallel: {rv.world} ranks over {rv.backend}"
        if not self.procs:
            return [f"{head}, started by torchrun (rank 0 at {rv.addr}:{rv.port})"]
        return [
            f"{head}, started here (meeting through a private file store, sockets on loopback only)",
            *(f"ubatch:   rank {i + 1} pid {p.pid}" for i, p in enumerate(self.procs)),
        ]

    def dead(self) -> str:
        """The ranks this process started that have exited, for the one-line fault message."""
        gone = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.procs) if p.exitcode is not None]
        return ", ".join(gone)

    def culprit(self) -> str:
        """Who failed: the ranks that exited, else the silent one(s) (a hang: alive, not answering).
        A killed rank's sockets can close before its exit is reaped: give the exits a second."""
        deadline = time.monotonic() + 1.0
        for p in self.procs:
            if not self.dead():
                p.join(max(0.0, deadline - time.monotonic()))
        if gone := self.dead():
            return gone
        w = self.group.world
        return "rank 1 (alive, not answering)" if w == 2 else f"one of ranks 1-{w - 1} (alive, not answering)"

    def stop(self) -> None:
        """Rank 0: tell the others to stop, wait for the ones it started, leave the group."""
        if self.stopped or self.rank != 0:
            return
        self.stopped = True
        try:
            if not self.dead():
                self.group.send(Stop())
        except UbatchError:
            pass  # a rank is gone already: the processes below are ended either way
        for p in self.procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        leave()
        if self.private_dir:
            shutil.rmtree(self.private_dir, ignore_errors=True)


def _rank_main(rv: Rendezvous) -> None:
    """A rank rank 0 started: join, follow, leave; a failure is one line on stderr."""
    torch.set_num_threads(1)  # the contexts set their own -t
    try:
        Ranks(join(rv)).serve()
    except UbatchError as e:
        print(f"ubatch rank {rv.rank}: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def start(world: int, timeout_s: float = DEFAULT_TIMEOUT_S, cuda: bool = False) -> Ranks:
    """Join or start a group of `world` ranks (torchrun's when its environment says so)."""
    rv = from_torchrun(world, timeout_s, cuda)
    if rv is not None:
        ranks = Ranks(join(rv))
        atexit.register(ranks.stop)  # rank 0 tells the others to stop; the others only leave
        return ranks
    if world < 2:
        raise TensorParallelError(f"--tensor-parallel {world}: tensor parallelism needs at least 2 ranks")
    if cuda and torch.cuda.device_count() < world:
        raise TensorParallelError(
            f"--tensor-parallel {world} needs {world} CUDA devices, one per rank; this machine has "
            f"{torch.cuda.device_count()}"
        )
    if sys.platform == "linux":  # every rank is on this machine: gloo and NCCL talk over loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (and never on the host's own addresses)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    private = tempfile.mkdtemp(prefix="ubatch-tp-")  # mode 0700: no other user reads or writes the store
    store = os.path.join(private, "store")
    spawn = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    for r in range(1, world):
        proc = spawn.Process(
            target=_rank_main, args=(Rendezvous(r, world, r, "127.0.0.1", 0, timeout_s, cuda, store=store),)
        )
        proc.daemon = True
        proc.start()
        procs.append(proc)
    try:
        group = join(Rendezvous(0, world, 0, "127.0.0.1", 0, timeout_s, cuda, store=store))
    except TensorParallelError:
        for p in procs:
            p.kill()
        shutil.rmtree(private, ignore_errors=True)
        raise
    ranks = Ranks(group, procs, private_dir=private)
    group.failed = ranks.culprit
    atexit.register(ranks.stop)
    return ranks


def launch(
    path: str | None, world: int, timeout_s: float = DEFAULT_TIMEOUT_S, cuda: bool = False
) -> tuple[Ranks, Model] | None:
    """The one entry of the CLI, the server and `Llama`: join or start `world` ranks (0: torchrun's
    size) and load rank 0's shard of the model at `path` (the other ranks load theirs when rank
    0 announces it). On a rank other than 0 (under torchrun) it does what rank 0 announces until
    rank 0 stops, then returns None: the caller ends."""
    ranks = start(world, timeout_s, cuda)
    if ranks.rank != 0:
        ranks.serve()
        return None
    if path is None:
        ranks.stop()
        raise TensorParallelError("tensor parallelism: rank 0 was started without a model to load")
    try:
        return ranks, load_shard(ranks.group, path, str(ranks.group.rv.device) if cuda else "cpu")
    except BaseException:
        ranks.stop()
        raise
