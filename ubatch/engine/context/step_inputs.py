"""The values of a graph's inputs for one ubatch (llama.cpp's set_input step), written in place.

Everything is computed on the host from the cell arrays, so nothing here waits for the device.
On host memory the values go straight into numpy views of the graph's input views (no tensor
made and copied per input per step); on a device each is one host-to-device copy. The RoPE
rows come from host tables the backend computes once (`Ops.rope_cache` over 0..N-1, grown by
doubling), so a step gathers rows instead of calling the backend.
"""

from __future__ import annotations

import numpy as np
import torch

from ubatch.engine.batch import UBatch
from ubatch.engine.graph.forward import NO_CAUSAL, GraphShape, mask_in_kernel, rope_keys
from ubatch.engine.kv.cache import KVCache, as_mask
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.model.model import Model
from ubatch.kernels.ops import KV_CHUNK, Ops

ROPE_ROWS_MIN = 1024  # first table size; doubled past the largest position seen


class StepInputs:
    """Fills the inputs of a context's graphs; holds the host RoPE tables between steps."""

    def __init__(self, model: Model, ops: Ops, causal: bool = True, freq_factors: torch.Tensor | None = None) -> None:
        """`causal` False: a query also sees the later tokens of its sequence (models with
        attention.causal = false); `freq_factors`: the context's per-pair RoPE divisors."""
        self.model, self.ops, self.causal, self.freq_factors = model, ops, causal, freq_factors
        self.rope = rope_keys(model)
        self._rope_names = [(f"inp_cos_{i}", f"inp_sin_{i}") for i in range(len(self.rope))]
        self._cache_names: list[tuple[str, ...]] = []  # per cache: its inputs' names
        self._starts: dict[tuple[int, ...], np.ndarray] = {}  # kv_starts by the groups' streams
        self._tables: dict[tuple[float, float], tuple[np.ndarray, np.ndarray]] = {}

    def rope_rows(self, key: tuple[float, float], pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin rows of a rope key's table for these positions (the backend's values)."""
        if pos.size == 1 and (p := int(pos[0])) >= 0:  # a decode step's row: a slice, no gather
            table = self._tables.get(key)
            if table is not None and table[0].shape[0] > p:
                return table[0][p : p + 1], table[1][p : p + 1]
        hi = int(pos.max()) if pos.size else 0
        if pos.size and int(pos.min()) < 0:  # no table for negative positions
            return self._backend_rows(key, torch.from_numpy(pos))
        table = self._tables.get(key)
        if table is None or table[0].shape[0] <= hi:
            size = max(ROPE_ROWS_MIN, 1 << hi.bit_length())
            table = self._tables[key] = self._backend_rows(key, torch.arange(size))
        cos, sin = table
        return cos[pos], sin[pos]

    def _backend_rows(self, key: tuple[float, float], pos: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        base, scale = key
        cos, sin = self.ops.rope_cache(pos, self.model.hparams.n_rot, base, scale, self.freq_factors)
        m = self.model.hparams.rope_mscale  # yarn's and LongRoPE's magnitude, as ggml's rope applies it
        if m != 1.0:
            cos, sin = cos * m, sin * m
        return cos.cpu().numpy(), sin.cpu().numpy()

    def fill(
        self,
        mem: KVMemory,
        ub: UBatch,
        slots: list[np.ndarray],
        shape: GraphShape,
        views: dict[str, torch.Tensor],
        host: dict[str, np.ndarray] | None,
        lora: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Write every input of the ubatch's graph: into `host` (numpy views of `views`) when
        given, else into `views` by one copy each. `lora`: each row's adapters and scales."""

        def put(name: str, value: np.ndarray | np.generic) -> None:  # numpy types a reduction as either
            if host is not None:
                np.copyto(host[name], value.reshape(host[name].shape))
            else:
                views[name].copy_(torch.from_numpy(np.ascontiguousarray(value)).view(views[name].shape))

        shard = self.model.shard
        put("inp_tokens", ub.token if shard is None else shard.local_tokens(ub.token))
        for key, (cos_name, sin_name) in zip(self.rope, self._rope_names):
            cos, sin = self.rope_rows(key, ub.pos)
            put(cos_name, cos)
            put(sin_name, sin)
        cells = mask_in_kernel(self.ops, mem)
        if cells:
            pos = ub.pos.astype(np.int32)
            put("inp_q_pos", pos)
            put("inp_q_lim", pos if self.causal else np.full_like(pos, NO_CAUSAL))
            put("inp_q_seq", np.left_shift(np.uint64(1), ub.seq_id0.astype(np.uint64)).view(np.int64))
        names = self._cache_names
        while len(names) < len(mem.caches):
            names.append(tuple(f"{n}_{len(names)}" for n in ("kq_mask", "kv_idxs", "kv_starts", "kv_visible")))
        for c, (cache, (mask_name, idxs_name, starts_name, visible_name)) in enumerate(zip(mem.caches, names)):
            streams, n_kv = cache.ubatch_streams(ub), shape.n_kv[c]
            vis = cache.visible(ub, streams, n_kv, self.causal)  # on the host: which chunks to read
            if cells:
                pos, bits = cell_arrays(cache, streams, n_kv)
                put(f"kv_pos_{c}", pos)
                put(f"kv_seq_{c}", bits)
            else:
                put(mask_name, as_mask(vis))
            put(idxs_name, slots[c])
            starts = self._starts.get(at := (*streams, cache.size))
            if starts is None:
                starts = self._starts[at] = np.array([s * cache.size for s in streams], dtype=np.int64)
            put(starts_name, starts)
            # 256-cell chunks no query can see (other sequences, outside the window) are skipped
            if vis.shape[0] * vis.shape[1] == 1:  # a lone row: no reduction over rows first
                put(visible_name, vis.reshape(-1, KV_CHUNK).any(1))
            else:
                put(visible_name, vis.reshape(-1, n_kv // KV_CHUNK, KV_CHUNK).any(axis=(0, 2)))
        if shape.n_outputs < shape.n_tokens:
            put("inp_out_ids", np.flatnonzero(ub.output))
        if self.model.hparams.mla is not None:  # latent attention's per-head products (GraphBlocks.head_ids)
            put("inp_head_ids", np.tile(np.arange(self.model.hparams.n_head, dtype=np.int32), shape.n_tokens))
        if shape.lora_slots:
            assert lora is not None
            put("lora_idx", lora[0])
            put("lora_scale", lora[1])


def cell_arrays(cache: KVCache, streams: list[int], n_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's first n_kv cells: position (-1 = empty) and sequence set as int64 bits."""
    cells = [cache.streams[s] for s in streams]
    pos = np.stack([x.pos[:n_kv] for x in cells]).astype(np.int32)
    weights = np.left_shift(np.uint64(1), np.arange(cache.n_seq_max, dtype=np.uint64))
    bits = np.stack([(x.seq[:n_kv].astype(np.uint64) * weights).sum(1, dtype=np.uint64) for x in cells])
    return pos, bits.view(np.int64)
