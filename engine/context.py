"""A context: the model plus its KV memory, decoding batches ubatch by ubatch.

`decode` follows llama.cpp's flow: validate the batch, split it into ubatches of at most
n_ubatch slots, place each ubatch in the KV cache, run the forward pass, and keep the logits of
the slots flagged as outputs (in batch order).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.ops import Ops, TorchOps
from .batch import Batch, split_simple
from .errors import ContextError
from .forward import forward
from .kv_cache import KVCache, KVMemory, round_up
from .model import Model
from .params import CParams, ContextParams, derive


@dataclass(slots=True)
class PerfCounters:
    """llama_perf_context's counters: multi-token decodes are prompt eval, 1-token ones eval."""

    t_p_eval_ms: float = 0.0
    n_p_eval: int = 0
    t_eval_ms: float = 0.0
    n_eval: int = 0
    n_decode: int = 0
    n_ubatch: int = 0
    graphs_reused: int = 0

    def reset(self) -> None:
        for f in self.__slots__:
            setattr(self, f, 0 if isinstance(getattr(self, f), int) else 0.0)


def build_memory(model: Model, cp: CParams) -> KVMemory:
    """One cache for all layers, or llama.cpp's iSWA pair when the model has a sliding window."""
    hp = model.hparams
    args = dict(n_seq_max=cp.n_seq_max, n_head_kv=hp.n_head_kv, head_k=hp.n_embd_head_k,
                head_v=hp.n_embd_head_v, type_k=cp.type_k, type_v=cp.type_v, device=model.device)
    # TODO(issue 3): per-sequence streams when not unified; one stream of n_ctx cells holds the
    # same total bytes meanwhile.
    size = cp.n_ctx
    if hp.n_swa <= 0:
        return KVMemory([KVCache(list(range(hp.n_layer)), size, **args)], [0] * hp.n_layer)
    base_layers = [il for il in range(hp.n_layer) if not hp.is_swa(il)]
    swa_layers = [il for il in range(hp.n_layer) if hp.is_swa(il)]
    size_base = cp.n_ctx_seq if cp.kv_unified or cp.n_seq_max == 1 else size
    n_seq_win = cp.n_seq_max if cp.kv_unified else 1
    size_swa = size_base if cp.swa_full else round_up(min(size_base, hp.n_swa * n_seq_win + cp.n_ubatch), 256)
    caches = [KVCache(base_layers, size_base, name="non-SWA", **args),
              KVCache(swa_layers, size_swa, n_swa=hp.n_swa, name="SWA", **args)]
    return KVMemory(caches, [1 if hp.is_swa(il) else 0 for il in range(hp.n_layer)])


class Context:
    def __init__(self, model: Model, params: ContextParams | None = None, ops: Ops | None = None) -> None:
        self.model = model
        self.params = params or ContextParams()
        self.cparams = derive(self.params, model.hparams)
        torch.set_num_threads(self.cparams.n_threads)
        self.ops = ops or TorchOps()
        self.memory = build_memory(model, self.cparams)
        self.perf = PerfCounters()
        self.logits = torch.empty(0, model.hparams.n_vocab)
        self.output_ids: list[int] = []  # batch index of each logits row
        self._last_shape: tuple[int, int, tuple[int, ...]] | None = None

    @property
    def n_ctx(self) -> int:
        return self.cparams.n_ctx

    def warmup(self) -> None:
        """Dequantise every weight once and run a 2-token decode, as llama.cpp warms up."""
        for w in self.model.matrices():
            w.dense(getattr(self.ops, "compute_dtype", torch.float32))
        v = self.model.vocab
        self.decode(Batch.from_tokens([v.bos, v.eos], 0))
        self.memory.clear()
        self.perf.reset()

    def validate(self, batch: Batch) -> None:
        cp, n_vocab = self.cparams, self.model.hparams.n_vocab
        if batch.n_tokens == 0:
            raise ContextError("decode: n_tokens == 0")
        if batch.n_tokens > cp.n_batch:
            raise ContextError(
                f"decode: batch of {batch.n_tokens} tokens exceeds n_batch = {cp.n_batch}; "
                f"split it or raise -b")
        tok = np.asarray(batch.token)
        bad = np.flatnonzero((tok < 0) | (tok >= n_vocab))
        if bad.size:
            raise ContextError(f"invalid token[{bad[0]}] = {tok[bad[0]]} (vocabulary has {n_vocab})")
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, (sids, p) in enumerate(zip(batch.seq_id, batch.pos)):
            for s in sids:
                if not 0 <= s < cp.n_seq_max:
                    raise ContextError(f"invalid seq_id[{i}] = {s} >= {cp.n_seq_max}")
                if s in last and p != last[s] + 1:
                    raise ContextError(f"sequence {s} positions are not continuous")
                first.setdefault(s, p)
                last[s] = p
        for s, p in first.items():
            x = self.memory.seq_pos_max(s)
            if x >= 0 and p != x + 1:
                raise ContextError(
                    f"the tokens of sequence {s} in the input batch have inconsistent sequence "
                    f"positions: the last position stored in the memory module is X = {x}, the "
                    f"first position in the batch is Y = {p}; it is required that Y = X + 1")

    def decode(self, batch: Batch) -> None:
        """Run a batch; afterwards `self.logits[i]` holds the i-th output slot's logits."""
        self.validate(batch)
        t0 = time.perf_counter()
        outs = []
        for ub in split_simple(batch, self.cparams.n_ubatch):
            cells = []
            for cache in self.memory.caches:
                slot = cache.find_slot(ub)
                if slot is None:
                    raise ContextError(
                        f"failed to find a KV slot for a ubatch of {ub.n_tokens} tokens "
                        f"({cache.used}/{cache.size} cells used); raise -c or clear the cache")
                cache.apply_ubatch(ub, slot)
                cells.append(slot)
            out_rows = np.flatnonzero(ub.output)
            shape = (ub.n_tokens, len(out_rows), tuple(c.n_kv for c in self.memory.caches))
            if shape == self._last_shape:
                self.perf.graphs_reused += 1
            self._last_shape = shape
            with torch.inference_mode():
                logits = forward(self.model, self.ops, ub, self.memory, cells, out_rows)
            outs.append(logits.float())
            self.perf.n_ubatch += 1
        self.logits = torch.cat(outs) if len(outs) > 1 else outs[0]
        self.output_ids = [i for i, f in enumerate(batch.logits) if f]
        dt = (time.perf_counter() - t0) * 1e3
        self.perf.n_decode += 1
        if batch.n_tokens == 1:
            self.perf.t_eval_ms += dt
            self.perf.n_eval += 1
        else:
            self.perf.t_p_eval_ms += dt
            self.perf.n_p_eval += batch.n_tokens
