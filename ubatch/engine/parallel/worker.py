"""Ranks 1..N-1: do what rank 0 announces, on this rank's shard, until rank 0 says stop.

Every message is a plain tuple (engine/context/context.py and engine/context/mirror.py send
them): ("model", key, path, device) loads and cuts the model; ("context", key, model key, params,
embeddings, pooling) builds a context; ("decode", key, batch, embeddings) runs a batch;
("memory", key, op, args) applies a KV cell operation; ("drop", key) frees a context; ("stop",)
ends the loop. Errors a batch or a cell operation meets are the same on every rank (the
bookkeeping is the same), so they are rank 0's to report; anything else ends this rank, and rank
0's next collective says which rank stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.context.mirror import MEMORY_OPS
from ubatch.engine.errors import ContextError
from ubatch.engine.model.model import Model
from ubatch.engine.model.shard import Shard
from ubatch.engine.parallel.group import RankLost, TPGroup
from ubatch.engine.params import ContextParams


def shard_of(group: TPGroup, n_vocab: int, channel: bool) -> Shard:
    """This rank's Shard: the group as its collective, the vocabulary split in equal slices."""
    rows = Shard.rows_of(n_vocab, group.world)
    return Shard(group.rank, group.world, group, rows, group if channel else None, group.rv.local_world)


def load_shard(group: TPGroup, path: str, device: str) -> Model:
    """Rank 0: the model as it holds it; the other ranks are told to load and cut theirs."""
    model = Model.load(path, "cpu")  # mapped: a row cut is a view; only the rank's part moves to `device`
    shard = shard_of(group, model.hparams.n_vocab, channel=True)
    sharded = model.sharded(shard, device)  # refused here, before any other rank loads anything
    with group.turn():
        group.send(("model", id(shard), path, device))
    return sharded


@dataclass
class Worker:
    group: TPGroup
    device: str
    models: dict[int, Model] = field(default_factory=dict)
    contexts: dict[int, Context] = field(default_factory=dict)

    def run(self) -> None:
        while True:
            msg = self.group.receive()
            if msg[0] == "stop":
                return
            self.handle(msg)

    def handle(self, msg: tuple[object, ...]) -> None:
        match msg:
            case ("model", int(key), str(path), str()):
                model = Model.load(path, "cpu")
                shard = shard_of(self.group, model.hparams.n_vocab, channel=False)
                self.models[key] = model.sharded(shard, self.device)
            case ("context", int(key), int(model), params, bool(embeddings), pooling):
                assert params is None or isinstance(params, ContextParams)
                assert pooling is None or isinstance(pooling, str)
                try:
                    self.contexts[key] = Context(self.models[model], params, embeddings=embeddings, pooling=pooling)
                except ContextError:
                    pass  # rank 0 refused the same context and said why
            case ("decode", int(key), Batch() as batch, bool(embeddings)):
                ctx = self.contexts.get(key)
                if ctx is None:
                    return
                ctx.embeddings = embeddings
                try:
                    ctx.decode(batch)
                except RankLost:
                    raise
                except ContextError:
                    pass  # the same refusal as rank 0's, before any collective
            case ("memory", int(key), str(op), tuple(args)):
                ctx = self.contexts.get(key)
                if ctx is not None:
                    try:
                        MEMORY_OPS[op](ctx.memory, *args)
                    except ContextError:
                        pass
            case ("drop", int(key)):
                self.contexts.pop(key, None)
            case _:
                raise RankLost(f"tensor parallelism: rank {self.group.rank} got an unknown message {msg[0]!r}")
