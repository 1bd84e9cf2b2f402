"""Save one sequence's KV cells and restore them into a sequence of a context.

`capture` reads, for every KV cache of the memory (one cache, or gemma3's iSWA pair), the cells
the sequence owns, ordered by position, with their K and V rows as stored (any cache type).
`restore` checks everything first — the model, the cache types and layers, every tensor's
shape and type, the positions, and that the target stream has free cells for all of it — and
only then clears the target sequence and writes the cells, so a refused state leaves the cache
as it was. Generation then continues as if the tokens had been decoded again: the next decode
re-evaluates the last token for its logits, as a prompt-cache hit does.
"""

from __future__ import annotations

import numpy as np
import torch

from ubatch.engine.context.context import Context
from ubatch.engine.context.state_file import ModelId, SeqState, StateError, differences, model_id
from ubatch.engine.errors import EngineError, ErrorKind
from ubatch.engine.kv.cache import KVCache
from ubatch.engine.params import context_holds


def _header(ctx: Context) -> dict[str, str]:
    cp, hp = ctx.cparams, ctx.model.hparams
    c0 = ctx.memory.caches[0]
    return {
        **model_id(ctx.model).to_header(),
        "type_k": c0.type_k,
        "type_v": c0.type_v,
        "n_ctx": str(cp.n_ctx_seq),
        "n_swa": str(hp.n_swa),
        "swa_full": str(bool(cp.swa_full)).lower(),
        "n_caches": str(len(ctx.memory.caches)),
    }


def _cells(c: KVCache, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The sequence's cells in its stream, ordered by position, and their global rows."""
    st = c.stream_of(seq_id)
    cells = c.streams[st]
    idx = np.flatnonzero(cells.seq[:, seq_id])
    idx = idx[np.argsort(cells.pos[idx], kind="stable")]
    return idx, idx + st * c.size


def _whole_cache(ctx: Context) -> None:
    """A saved state is the whole of a sequence's K/V rows; under tensor parallelism each rank
    holds only its heads' rows, so there is nothing whole to save or restore."""
    if ctx.model.shard is not None:
        raise EngineError(
            ErrorKind.NOT_SUPPORTED,
            "saving or restoring a sequence's KV state is not supported with tensor parallelism (-tp): "
            "each rank holds only its heads' rows",
        )


def capture(ctx: Context, seq_id: int, tokens: list[int]) -> SeqState:
    """The state of sequence `seq_id`, whose cells hold `tokens` (by position)."""
    _whole_cache(ctx)
    ctx.memory.update(ctx.model.hparams, ctx.ops, ctx.rope_freqs)  # queued copies and K-shifts first
    tensors: dict[str, torch.Tensor] = {}
    for ci, c in enumerate(ctx.memory.caches):
        idx, rows = _cells(c, seq_id)
        cells = c.streams[c.stream_of(seq_id)]
        tensors[f"c{ci}.pos"] = torch.from_numpy(cells.pos[idx].copy())
        sel = torch.from_numpy(rows)
        for il in c.layers:
            tensors[f"c{ci}.k{il}"] = c.k[il].data.index_select(0, sel.to(c.k[il].data.device)).cpu()
            tensors[f"c{ci}.v{il}"] = c.v[il].data.index_select(0, sel.to(c.v[il].data.device)).cpu()
    return SeqState(_header(ctx), list(tokens), tensors)


def _check(ctx: Context, state: SeqState, seq_id: int) -> list[tuple[np.ndarray, int]]:
    """Every reason to refuse, before anything changes; returns, per cache, the free cells to
    use and the first saved cell they take (a sliding-window cache may take only the tail)."""
    h, mine = state.header, _header(ctx)
    if not 0 <= seq_id < ctx.cparams.n_seq_max:
        raise StateError(f"sequence id {seq_id} is out of range: this context has {ctx.cparams.n_seq_max} sequences")
    saved_id, my_id = ModelId.from_header(h), ModelId.from_header(mine)
    if saved_id != my_id:
        diffs = differences(saved_id, my_id)
        diffs += [
            f"KV cache type {key[-1].upper()} differs ({h.get(key)} vs {mine[key]})"
            for key in ("type_k", "type_v")
            if h.get(key) != mine[key]
        ]
        raise StateError(f"the state was saved with another model (saved vs this one): {', '.join(diffs)}")
    for key, what in (("type_k", "-ctk"), ("type_v", "-ctv")):
        if h.get(key) != mine[key]:
            raise StateError(
                f"the state's K/V cache type {key[-1].upper()} is {h.get(key)}, this context's is {mine[key]} ({what})"
            )
    if h.get("n_caches") != mine["n_caches"]:
        raise StateError(f"the state holds {h.get('n_caches')} KV caches, this context has {mine['n_caches']}")
    n_ctx = ctx.cparams.n_ctx_seq
    if state.n_tokens > n_ctx:
        raise StateError(
            f"the state holds {state.n_tokens} tokens but {context_holds(ctx.params, ctx.cparams)}; raise -c"
        )
    n_vocab = ctx.model.hparams.n_vocab
    if any(t < 0 or t >= n_vocab for t in state.tokens):
        raise StateError("the state file holds token ids outside the vocabulary")
    expected = {f"c{ci}.{kv}{il}" for ci, c in enumerate(ctx.memory.caches) for il in c.layers for kv in "kv"}
    expected |= {f"c{ci}.pos" for ci in range(len(ctx.memory.caches))}
    if set(state.tensors) != expected:
        raise StateError("the state file's tensors do not match this model's KV caches (corrupt or another model)")
    plan = []
    for ci, c in enumerate(ctx.memory.caches):
        pos = state.tensors[f"c{ci}.pos"]
        if pos.dtype != torch.int64 or pos.dim() != 1:
            raise StateError("the state file's positions are malformed")
        p = pos.numpy()
        n = p.size
        if n and (p[0] < 0 or p[-1] >= n_ctx or (n > 1 and bool((np.diff(p) <= 0).any()))):
            raise StateError(f"the state file's positions are invalid for a context of {n_ctx}")
        if ci == 0 and n != state.n_tokens:
            raise StateError(f"the state file holds {n} cells for {state.n_tokens} tokens (corrupt)")
        for il in c.layers:
            for kv, store in (("k", c.k[il]), ("v", c.v[il])):
                t = state.tensors[f"c{ci}.{kv}{il}"]
                if t.dtype != store.data.dtype or tuple(t.shape) != (n, *store.data.shape[1:]):
                    raise StateError(
                        f"the state file's {kv.upper()} rows of layer {il} do not fit this cache (corrupt?)"
                    )
        st = c.stream_of(seq_id)
        cells = c.streams[st]
        free = np.flatnonzero((cells.pos < 0) | (cells.seq[:, seq_id] & (cells.seq.sum(1) == 1)))
        first = 0
        if c.n_swa > 0 and free.size < n:  # e.g. saved with --swa-full: keep what the window still needs
            first = int(np.searchsorted(p, p[-1] - c.n_swa))
        if free.size < n - first:
            name = f"{c.name} " if c.name else ""
            raise StateError(
                f"no room in the {name}KV cache: the state needs {n} cells, {free.size} are free; raise -c"
            )
        plan.append((free[: n - first], first))
    return plan


def restore(ctx: Context, state: SeqState, seq_id: int) -> int:
    """Replace sequence `seq_id`'s cells with the state's; returns the tokens restored."""
    _whole_cache(ctx)
    plan = _check(ctx, state, seq_id)
    ctx.memory.update(ctx.model.hparams, ctx.ops, ctx.rope_freqs)
    ctx.memory.seq_rm(seq_id)
    for ci, (c, (cells_idx, first)) in enumerate(zip(ctx.memory.caches, plan)):
        st = c.stream_of(seq_id)
        cells = c.streams[st]
        cells.pos[cells_idx] = state.tensors[f"c{ci}.pos"].numpy()[first:]
        cells.seq[cells_idx, seq_id] = True
        cells.shift[cells_idx] = 0
        cells.touch()
        rows = torch.from_numpy(cells_idx + st * c.size)
        for il in c.layers:
            for store, t in ((c.k[il], state.tensors[f"c{ci}.k{il}"]), (c.v[il], state.tensors[f"c{ci}.v{il}"])):
                store.data[rows.to(store.data.device)] = t[first:].to(store.data.device)
        if cells_idx.size:
            cells.head = int(cells_idx[-1]) + 1 if cells_idx[-1] + 1 < cells.size else 0
    return state.n_tokens


def usable_prefix(ctx: Context, seq_id: int, n_match: int) -> int:
    """How many of a restored sequence's first tokens a new prompt may keep (at most n_match):
    with a sliding window the cells the next token must see have to be there, else 0."""
    n_swa = ctx.model.hparams.n_swa
    if n_match > 0 and n_swa > 0 and ctx.memory.seq_pos_min(seq_id) > max(0, n_match - n_swa):
        return 0
    return n_match
