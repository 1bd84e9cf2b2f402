"""Many sequences' logits rows sampled in one pass (the server's step samples every slot at once).

A sampler's chain batches when it is greedy in effect (an argmax, after the repetition penalties
if any) or llama.cpp's default shape, `[penalties] top_k [top_p] [min_p] [temperature]` then the
draw; `RowChain` is that chain's parameters. Everything else (DRY, typical, XTC, top-n-sigma,
dynamic temperature, mirostat, a chain in another order, top-k off) stays with the row's own
`Sampler.sample`, as do rows a caller keeps apart (a grammar, a reasoning budget, log-probs).

The pass computes what the stages do row by row, on the same values in the same order: the
penalties and biases written into the rows and put back after (no copy of a row), one top-k
over all rows (engine/sampling/stages.py `top_k_rows`, each row's result its own), then
top-p, min-p, temperature and the draw on the [rows, k] candidates, each row with its own
parameters and its own seeded stream. Masked candidates are -inf, which adds nothing to a
softmax in float64; top-p's float32 softmax runs over all k candidates, as the row's own does
(tests/test_sampling_batched.py compares token by token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from ubatch.engine.sampling.bias import LogitBias
from ubatch.engine.sampling.rng import Mt19937
from ubatch.engine.sampling.stages import Cands, Penalties, dist, f32, min_p, scale, top_k_rows, top_p
from ubatch.kernels.ops import argmax_rows

# the stages a batched chain may hold, in the only order it may hold them (llama.cpp's default)
BATCHED_ORDER = ("penalties", "top_k", "top_p", "min_p", "temperature")


@dataclass(frozen=True, slots=True)
class RowChain:
    """A chain the batched pass runs: greedy (argmax), or top-k then what follows; None marks
    a stage that is off."""

    greedy: bool
    penalties: Penalties | None = None
    k: int = 0
    top_p: float | None = None
    min_p: float | None = None
    min_keep: int = 0
    temp: float | None = None  # the temperature stage's divisor (> 0), None: off


def row_chain(
    names: Sequence[str],
    penalties: Penalties | None,
    greedy: bool,
    top_k: int,
    top_p: float,
    min_p: float,
    min_keep: int,
    temp: float,
    dynatemp: bool,
) -> RowChain | None:
    """The batched form of a chain whose enabled stages are `names` (greedy: the argmax
    shortcut with those logit modifiers), or None where only the row's own chain will do."""
    if greedy:
        return RowChain(True, penalties) if all(n == "penalties" for n in names) else None
    if "top_k" not in names or dynatemp or any(n not in BATCHED_ORDER for n in names):
        return None
    if list(names) != sorted(names, key=BATCHED_ORDER.index):
        return None
    if "temperature" in names and f32(temp) <= 0:
        return None
    return RowChain(
        False,
        penalties,
        top_k,
        top_p if "top_p" in names else None,
        min_p if "min_p" in names else None,
        min_keep,
        temp if "temperature" in names else None,
    )


@dataclass(frozen=True, slots=True)
class Row:
    """One row to sample: its index in the logits, its chain, its draw's stream, its biases."""

    index: int
    chain: RowChain
    rng: Mt19937
    bias: LogitBias | None = None


@contextmanager
def single_threaded() -> Iterator[None]:
    """torch's host ops on one thread meanwhile. Sampling's tensors are tiny ([rows, k]), yet
    an op over several rows may still hand work to the intra-op pool, and on a busy machine
    the wait for that second thread was 5-20 ms for a [16, 40] softmax (measured; 2 us on
    one thread). Switching costs about a microsecond; the values do not change (no op here
    splits a reduction between threads)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def sample_rows(
    logits: torch.Tensor, rows: Sequence[Row], argmax: Callable[[torch.Tensor], list[int]] = argmax_rows
) -> list[int]:
    """Each row's token, as its own chain would sample it; `logits` (host memory, float32,
    [n, n_vocab]) is as it was on return. `argmax` gives every row's first maximum as
    numpy's argmax does (the backend's own: the CPU's reads each thread's part where its GEMV
    wrote it)."""
    if all(r.chain.greedy and r.chain.penalties is None for r in rows):
        best = argmax(logits)
        return [_argmax(logits, best[r.index], r) for r in rows]
    out = [0] * len(rows)
    torch_ops = any(not r.chain.greedy or r.chain.penalties is not None for r in rows)
    with single_threaded() if torch_ops else nullcontext(), ExitStack() as undo:
        for r in rows:
            x = logits[r.index]
            if r.bias is not None:
                undo.enter_context(r.bias.on(x))
            if r.chain.penalties is not None:
                applied = r.chain.penalties.apply_(x)
                undo.callback(Penalties.undo, x, applied)
        lx = logits.numpy()
        greedy = [i for i, r in enumerate(rows) if r.chain.greedy]
        for i in greedy:  # numpy's argmax: the first maximum, as the row's own shortcut
            out[i] = int(np.argmax(lx[rows[i].index]))
        by_k: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if not r.chain.greedy:
                by_k.setdefault(r.chain.k, []).append(i)
        for k, group in by_k.items():
            for i, tok in zip(group, _top_k_chain(lx, [rows[i] for i in group], k), strict=True):
                out[i] = tok
    return out


def _argmax(logits: torch.Tensor, tok: int, r: Row) -> int:
    """A greedy row without penalties whose plain argmax is `tok`: the first maximum, as the
    row's own shortcut. Biases that only lower are written into the row only when `tok` is one
    of their tokens: otherwise it is the biased row's too."""
    b = r.bias
    if b is None or b.lowers_only and tok not in b.id_set:
        return tok
    with b.on(logits[r.index]) as biased:
        return int(np.argmax(biased.numpy()))


def _top_k_chain(lx: np.ndarray, rows: Sequence[Row], k: int) -> list[int]:
    """top-k over the rows' logits, then each row's top-p, min-p, temperature and draw."""
    idx = np.array([r.index for r in rows])
    span = lx[idx[0] : idx[0] + len(idx)] if np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))) else lx[idx]
    v, ids = top_k_rows(span, k)
    if len(rows) == 1:  # one row: its own stages take fewer ops than the [rows, k] pass
        return [_row_tail(rows[0], Cands(torch.from_numpy(v[0]), torch.from_numpy(ids[0]), True))]
    vals = torch.from_numpy(v)
    n_rows, k = vals.shape
    n = torch.full((n_rows, 1), k, dtype=torch.long)
    min_keep = torch.tensor([[max(r.chain.min_keep, 1)] for r in rows])
    if any(r.chain.top_p is not None for r in rows):  # over all k candidates, still sorted
        cum = torch.cumsum(torch.softmax(vals, 1), 1)
        p = torch.tensor([[r.chain.top_p if r.chain.top_p is not None else 1.0] for r in rows])
        keep = torch.minimum(torch.maximum(torch.searchsorted(cum, p, right=False) + 1, min_keep), n)
        on = torch.tensor([[r.chain.top_p is not None] for r in rows])
        n = torch.where(on, keep, n)
    if any(r.chain.min_p is not None for r in rows):  # a prefix: the candidates are sorted
        log_p = torch.tensor([[float(np.log(r.chain.min_p)) if r.chain.min_p is not None else 0.0] for r in rows])
        col = torch.arange(k)[None, :]
        above = ((vals >= vals[:, :1] + log_p) & (col < n)).sum(1, keepdim=True)
        keep = torch.minimum(torch.maximum(above, min_keep), n)
        on = torch.tensor([[r.chain.min_p is not None] for r in rows])
        n = torch.where(on, keep, n)
    if any(r.chain.temp is not None for r in rows):
        vals = vals / torch.tensor([[r.chain.temp if r.chain.temp is not None else 1.0] for r in rows])
    vals = vals.masked_fill(torch.arange(k)[None, :] >= n, float("-inf"))
    cum = torch.cumsum(torch.softmax(vals.double(), 1), 1)
    last = (n - 1).view(-1).tolist()
    total = cum.gather(1, n - 1).view(-1).tolist()
    u = torch.tensor([[r.rng.uniform() * t] for r, t in zip(rows, total)], dtype=torch.float64)
    at = torch.searchsorted(cum, u).view(-1).tolist()
    return [int(ids[i, min(a, m)]) for i, (a, m) in enumerate(zip(at, last))]


def _row_tail(r: Row, c: Cands) -> int:
    """What follows top-k in one row's chain, by the chain's own stages."""
    ch = r.chain
    if ch.top_p is not None:
        c = top_p(c, ch.top_p, ch.min_keep)
    if ch.min_p is not None:
        c = min_p(c, ch.min_p, ch.min_keep)
    if ch.temp is not None:
        c = scale(c, ch.temp)
    return dist(c, r.rng)
