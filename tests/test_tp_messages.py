"""Rank 0's messages under tensor parallelism (engine/context/messages.py), replayed by a
worker without a process group: each one does on the worker what rank 0 did, by its key, and a
message the protocol does not know stops the rank in one line."""

from __future__ import annotations

import gc
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import FrozenInstanceError
from types import SimpleNamespace

import pytest

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.context.messages import Decode, DropContext, MemoryOp, NewContext, new_key
from ubatch.engine.model.model import Model
from ubatch.engine.parallel.group import RankLost
from ubatch.engine.parallel.worker import Worker
from ubatch.engine.params import ContextParams


def test_messages_are_frozen_picklable_values_with_their_own_keys() -> None:
    a, b = new_key(), new_key()
    assert a != b
    msg = Decode(a, Batch.from_tokens([2, 5, 7], 0), False)
    assert pickle.loads(pickle.dumps(msg)) == msg
    with pytest.raises(FrozenInstanceError):
        msg.key = b  # type: ignore[misc]


def test_a_worker_replays_contexts_decodes_and_cell_operations_by_key(tiny_llama_model: Model) -> None:
    params = ContextParams(n_ctx=256, n_seq_max=2, n_outputs_max=2)
    w = Worker(SimpleNamespace(rank=1), "cpu", {7: tiny_llama_model})  # type: ignore[arg-type]
    w.handle(NewContext(3, 7, params, False, None))
    w.handle(Decode(3, Batch.from_tokens([2, 10, 11, 12], 0, seq_id=1), False))
    w.handle(MemoryOp(3, "seq_rm", (1, 2, -1)))
    ref = Context(tiny_llama_model, params)
    ref.decode(Batch.from_tokens([2, 10, 11, 12], 0, seq_id=1))
    ref.memory.seq_rm(1, 2, -1)
    mine = w.contexts[3].memory
    assert mine.used == ref.memory.used == 2 and mine.seq_pos_max(1) == ref.memory.seq_pos_max(1) == 1
    w.handle(Decode(99, Batch.from_tokens([2], 0), False))  # a context rank 0 refused: nothing to run
    w.handle(DropContext(3))
    assert w.contexts == {}
    with pytest.raises(RankLost, match="unknown memory operation 'format_disk'"):
        w.handle(MemoryOp(3, "format_disk", ()))
    with pytest.raises(RankLost, match="unknown message"):
        w.handle(("decode", 3))  # type: ignore[arg-type]  # the old tuples are not messages


def test_a_set_up_fault_is_a_tensor_parallel_error_and_still_a_context_error() -> None:
    from ubatch.engine.errors import ContextError, TensorParallelError
    from ubatch.engine.parallel.launch import start

    with pytest.raises(TensorParallelError, match="needs at least 2 ranks") as e:
        start(1)
    assert isinstance(e.value, ContextError)  # callers that catch a context's refusal still do


def test_a_context_tells_its_work_through_its_hook_and_a_worker_replays_it(tiny_llama_model: Model) -> None:
    """The context sends nothing itself: its hook sees the build, each decode and each cell
    operation (a nested one once), in order, before the work runs; replayed, the same cells."""
    told: list[object] = []
    dropped: list[int] = []

    class Record:
        @contextmanager
        def __call__(self, msg: object) -> Iterator[None]:
            told.append(msg)
            yield

        def dropped(self, key: int) -> None:
            dropped.append(key)

    params = ContextParams(n_ctx=256, n_seq_max=2, n_outputs_max=2, kv_unified=True)
    ctx = Context(tiny_llama_model, params, announce=Record())
    ctx.decode(Batch.from_tokens([2, 10, 11, 12], 0, seq_id=0))
    ctx.memory.seq_cp(0, 1, 0, 2)
    ctx.memory.seq_add(1, 1, 2, 5)  # separates the shared cell first: one message
    assert [type(m).__name__ for m in told] == ["NewContext", "Decode", "MemoryOp", "MemoryOp"]
    assert [m.op for m in told if isinstance(m, MemoryOp)] == ["seq_cp", "seq_add"]
    w = Worker(SimpleNamespace(rank=1), "cpu", {0: tiny_llama_model})  # type: ignore[arg-type]
    for m in told:
        w.handle(m)  # type: ignore[arg-type]
    mine, ref = w.contexts[ctx.tp_key].memory, ctx.memory
    assert mine.used == ref.used and [mine.seq_pos_max(s) for s in (0, 1)] == [ref.seq_pos_max(s) for s in (0, 1)]
    key = ctx.tp_key
    del ctx
    gc.collect()
    assert dropped == [key]
