"""Ranks 1..N-1: do what rank 0 announces, on this rank's shard, until rank 0 says stop.

The messages are engine/context/messages.py's (rank 0's contexts and their mirrored memory send
them): `LoadModel` loads and cuts the model, `NewContext` builds a context, `Decode` runs a batch,
`MemoryOp` applies a KV cell operation, `DropContext` frees a context, `Stop` ends the loop; each
names its model or context by rank 0's key. Errors a batch or a cell operation meets are the same
on every rank (the bookkeeping is the same), so they are rank 0's to report; anything else ends
this rank, and rank 0's next collective says which rank stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ubatch.engine.context.context import Context
from ubatch.engine.context.messages import Decode, DropContext, LoadModel, MemoryOp, Message, NewContext, Stop, new_key
from ubatch.engine.context.mirror import MEMORY_OPS
from ubatch.engine.errors import ContextError
from ubatch.engine.model.model import Model
from ubatch.engine.model.shard import Shard
from ubatch.engine.parallel.group import RankLost, TPGroup


def shard_of(group: TPGroup, n_vocab: int, channel: bool, key: int = 0) -> Shard:
    """This rank's Shard: the group as its collective, the vocabulary split in equal slices."""
    rows = Shard.rows_of(n_vocab, group.world)
    return Shard(group.rank, group.world, group, rows, group if channel else None, group.rv.local_world, key)


def load_shard(group: TPGroup, path: str, device: str) -> Model:
    """Rank 0: the model as it holds it; the other ranks are told to load and cut theirs."""
    model = Model.load(path, "cpu")  # mapped: a row cut is a view; only the rank's part moves to `device`
    shard = shard_of(group, model.hparams.n_vocab, channel=True, key=new_key())
    sharded = model.sharded(shard, device)  # refused here, before any other rank loads anything
    with group.turn():
        group.send(LoadModel(shard.key, path, device))
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
            if isinstance(msg, Stop):
                return
            self.handle(msg)

    def handle(self, msg: Message) -> None:
        match msg:
            case LoadModel(key, path, _):
                model = Model.load(path, "cpu")
                shard = shard_of(self.group, model.hparams.n_vocab, channel=False)
                self.models[key] = model.sharded(shard, self.device)
            case NewContext(key, model, params, embeddings, pooling):
                try:
                    self.contexts[key] = Context(self.models[model], params, embeddings=embeddings, pooling=pooling)
                except ContextError:
                    pass  # rank 0 refused the same context and said why
            case Decode(key, batch, embeddings):
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
            case MemoryOp(key, op, args):
                ctx = self.contexts.get(key)
                if ctx is not None and op in MEMORY_OPS:
                    try:
                        MEMORY_OPS[op](ctx.memory, *args)
                    except ContextError:
                        pass
                elif op not in MEMORY_OPS:
                    raise RankLost(f"tensor parallelism: rank {self.group.rank} got an unknown memory operation {op!r}")
            case DropContext(key):
                self.contexts.pop(key, None)
            case _:
                raise RankLost(f"tensor parallelism: rank {self.group.rank} got an unknown message {msg!r}")
