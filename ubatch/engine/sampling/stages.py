"""The stages of llama.cpp's sampler chain that filter or reshape the candidates.

Each stage takes and returns a `Cands` (llama_token_data_array): the logits of the tokens still
in the running, their ids, and whether they are sorted by logit. The order matters beyond the
set: the final draw walks the candidates in their current order, and llama.cpp only sorts when
a stage needs it (top-k, top-p, typical, XTC, dynamic temperature), so with those off the draw
runs in token-id order. Parameters are float in llama.cpp; comparisons here use the float32
value (`f32`) so a boundary falls where it falls there.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import torch

from ubatch.engine.sampling.rng import Mt19937

NEG_INF = float("-inf")


def f32(v: float) -> float:
    """A Python float holding exactly the float32 value llama.cpp stores."""
    return float(np.float32(v))


@dataclass(slots=True)
class Cands:
    logits: torch.Tensor  # float32
    ids: torch.Tensor | None = None  # None: every token, in id order
    sorted: bool = False

    @property
    def size(self) -> int:
        return self.logits.numel()

    def token(self, i: int) -> int:
        return i if self.ids is None else int(self.ids[i])

    def take(self, idx: torch.Tensor, sorted: bool) -> Cands:
        return Cands(self.logits[idx], idx if self.ids is None else self.ids[idx], sorted)

    def head(self, n: int) -> Cands:
        ids = torch.arange(n) if self.ids is None else self.ids[:n]
        return Cands(self.logits[:n], ids, self.sorted)

    def drop(self, n: int) -> Cands:
        """Without the first n candidates (XTC)."""
        ids = torch.arange(n, self.size) if self.ids is None else self.ids[n:]
        return Cands(self.logits[n:], ids, self.sorted)

    def sort(self) -> Cands:
        """Sorted by logit, descending (a no-op if already)."""
        if self.sorted:
            return self
        vals, idx = torch.topk(self.logits, self.size)
        return Cands(vals, idx if self.ids is None else self.ids[idx], True)

    def locate(self, table: dict[int, float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of the candidates whose token is a key of `table`, and the values."""
        if self.ids is None:
            toks = [t for t in table if 0 <= t < self.size]
            return torch.tensor(toks, dtype=torch.long), torch.tensor([table[t] for t in toks], dtype=torch.float32)
        pos = torch.nonzero(torch.isin(self.ids, torch.tensor(list(table), dtype=torch.long))).flatten()
        return pos, torch.tensor([table[int(t)] for t in self.ids[pos]], dtype=torch.float32)


def probs_f32(logits: torch.Tensor) -> torch.Tensor:
    """llama_sampler_softmax_impl's probabilities in float32 (summed in another order than
    llama.cpp's loop, so equal to its values up to float rounding)."""
    e = torch.exp(logits - logits.max())
    return e / e.sum()


def first_best(x: torch.Tensor) -> int:
    """The index of the first maximum (numpy's argmax is many times faster on a CPU row)."""
    return int(np.argmax(x.numpy())) if x.device.type == "cpu" else int(torch.argmax(x))


class Penalties:
    """Repeat (divide a positive logit, multiply a negative one), frequency and presence
    penalties over the last `last_n` tokens accepted (ubatch's -1: the whole history)."""

    def __init__(self, last_n: int, repeat: float, freq: float, present: float) -> None:
        self.history: deque[int] = deque(maxlen=last_n if last_n > 0 else None)
        self.repeat, self.freq, self.present = repeat, freq, present

    def accept(self, token: int) -> None:
        self.history.append(token)

    def __call__(self, c: Cands) -> Cands:
        if not self.history:
            return Cands(c.logits, c.ids, False)
        x = c.logits.clone()
        self._penalise(x, *c.locate(dict(Counter(self.history))))
        return Cands(x, c.ids, False)

    def _penalise(self, x: torch.Tensor, pos: torch.Tensor, cnt: torch.Tensor) -> None:
        v = x[pos]
        v = torch.where(v <= 0, v * self.repeat, v / self.repeat)
        x[pos] = v - (cnt * self.freq + (cnt > 0).float() * self.present)

    def apply_(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The penalties written into a whole row (token ids = columns), the values they
        replaced returned for `undo`: the same values `__call__` gives, without copying the row."""
        if not self.history:
            return None
        pos, cnt = Cands(row).locate(dict(Counter(self.history)))
        saved = row[pos]
        self._penalise(row, pos, cnt)
        return pos, saved

    @staticmethod
    def undo(row: torch.Tensor, applied: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if applied is not None:
            row[applied[0]] = applied[1]


def top_k(c: Cands, k: int) -> Cands:
    k = min(k, c.size)
    if c.sorted:
        return c.head(k)
    if c.logits.device.type == "cpu":
        v, i = top_k_rows(c.logits.numpy()[None], k)
        vals, idx = torch.from_numpy(v[0]), torch.from_numpy(i[0])
    else:
        vals, idx = torch.topk(c.logits, k)
    return Cands(vals, idx if c.ids is None else c.ids[idx], True)


TOP_K_STRIDE = 64  # one logit in 64 estimates where a row's k best begin


def top_k_rows(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest values of each row of `x` [rows, n] and their columns, best first, equal
    values in column order (a stable sort's first k; llama.cpp leaves their order open).
    Each row's result depends on that row alone (`top_k_row`)."""
    k = min(k, x.shape[1])
    vals = np.empty((x.shape[0], k), dtype=x.dtype)
    cols = np.empty((x.shape[0], k), dtype=np.int64)
    for i in range(x.shape[0]):
        vals[i], cols[i] = top_k_row(x[i], k)
    return vals, cols


def top_k_row(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`top_k_rows` of one row. The k-th largest of every 64th value is at most the row's k-th
    largest, so only the values at or above it (about 64 k of them) are looked at: ~10x
    torch.topk on a 262k vocabulary."""
    sub = x[::TOP_K_STRIDE]
    if sub.size > k:
        cand = np.flatnonzero(x >= np.partition(sub, sub.size - k)[sub.size - k])
        v = x[cand]
        if v.size >= k:
            kth = np.partition(v, v.size - k)[v.size - k]
            above = np.flatnonzero(v > kth)
            pos = np.sort(np.concatenate((above, np.flatnonzero(v == kth)[: k - above.size])))
            if pos.size == k:  # else NaN logits: no floor holds
                pos = pos[np.argsort(-v[pos], kind="stable")]
                return v[pos], cand[pos]
    cols = np.argsort(-x, kind="stable")[:k]
    return x[cols], cols


def top_p(c: Cands, p: float, min_keep: int) -> Cands:
    """The smallest sorted prefix whose probability mass reaches p (at least min_keep).
    Unsorted candidates are sorted only as far as needed: the best 256 first, as llama.cpp."""
    if not c.sorted and c.size > 1024 and min_keep <= 256:
        probs = torch.softmax(c.logits, 0)
        top, idx = torch.topk(probs, 256)
        cum = torch.cumsum(top, 0)
        n_keep = int(torch.searchsorted(cum, torch.tensor([p]), right=False)) + 1
        if n_keep <= 256:
            idx = idx[: max(n_keep, min_keep, 1)]
            return Cands(c.logits[idx], idx if c.ids is None else c.ids[idx], True)
    c = c.sort()
    cum = torch.cumsum(torch.softmax(c.logits, 0), 0)
    n_keep = int(torch.searchsorted(cum, torch.tensor([p]), right=False)) + 1
    return c.head(min(max(n_keep, min_keep, 1), c.size))


def min_p(c: Cands, p: float, min_keep: int) -> Cands:
    """Tokens with probability >= p * the best one's; unsorted candidates stay in their order."""
    if c.size == 0:
        return c
    log_p = float(np.log(p))
    if not c.sorted:
        keep = c.logits >= c.logits.max() + log_p
        n = int(keep.sum())
        if n > 0 and n >= min_keep:
            return c.take(torch.nonzero(keep).flatten(), False)
        c = c.sort()
    keep = c.logits >= c.logits[0] + log_p
    return c.head(min(max(int(keep.sum()), min_keep, 1), c.size))


def typical(c: Cands, p: float, min_keep: int) -> Cands:
    """Locally typical sampling: the tokens whose surprise is closest to the entropy, until
    their mass passes p. llama.cpp sorts every candidate first; only the order by distance
    matters to the result, so that order is taken as far as needed (256, 4096, ... tokens)."""
    probs = probs_f32(c.logits)
    logp = torch.log(probs)
    dist = torch.abs(-logp - (-(probs * logp).sum()))
    k = c.size if c.size <= 1024 else 256
    while True:
        order = torch.argsort(dist, stable=True)[:k] if k == c.size else torch.topk(dist, k, largest=False).indices
        reached = torch.cumsum(probs[order], 0) > f32(p)
        reached[: max(min_keep - 1, 0)] = False
        hit = torch.nonzero(reached).flatten()
        if hit.numel() or k == c.size:
            return c.take(order[: int(hit[0]) + 1 if hit.numel() else k], False)
        k = min(k * 16, c.size)


def top_n_sigma(c: Cands, n: float) -> Cands:
    """Mask (-inf) the logits more than n standard deviations below the best one."""
    if c.size <= 1:
        return c
    x = c.logits
    v = x[x != NEG_INF] if float(x.min()) == NEG_INF else x  # -inf (masked) logits do not count
    top = float(x[0]) if v.numel() == 0 else max(float(x[0]), float(v.max()))
    mean, std = np.float32(0), np.float32(0)
    if v.numel():
        count = np.float32(v.numel())
        mean = np.float32(float(v.sum())) / count
        d = v - float(mean)
        std = np.sqrt(np.float32(float(torch.dot(d, d))) / count)
    thr = float(np.float32(top) - np.float32(n) * std)
    return Cands(x.masked_fill(x < thr, NEG_INF), c.ids, c.sorted)


class Xtc:
    """Exclude Top Choices: with chance `prob`, drop every token above `thr` but the last."""

    def __init__(self, prob: float, thr: float, min_keep: int, rng: Mt19937) -> None:
        self.prob, self.thr, self.min_keep, self.rng = f32(prob), f32(thr), min_keep, rng

    def __call__(self, c: Cands) -> Cands:
        if c.size < 2 or self.rng.uniform_float() > self.prob:
            return c
        c = c.sort()
        below = torch.nonzero(probs_f32(c.logits) < self.thr).flatten()
        pos_last = max((int(below[0]) if below.numel() else c.size) - 1, 0)
        if c.size - pos_last >= self.min_keep and pos_last > 0:
            return c.drop(pos_last)
        return c


def scale(c: Cands, temp: float) -> Cands:
    """llama_sampler_temp_impl: divide by temp; temp <= 0 keeps only the first best token."""
    if temp <= 0:
        i = first_best(c.logits)
        x = torch.full_like(c.logits, NEG_INF)
        x[i] = c.logits[i]
        return Cands(x, c.ids, c.sorted)
    return Cands(c.logits / temp, c.ids, c.sorted)


def temperature(c: Cands, temp: float, delta: float, exponent: float) -> Cands:
    """temp_ext: with delta > 0 the temperature follows the normalised entropy (dynatemp)."""
    if delta <= 0:
        return scale(c, temp)
    if c.size <= 1:
        return c
    t, d = np.float32(temp), np.float32(delta)
    lo, hi = max(np.float32(0), t - d), t + d
    max_entropy = -np.log(np.float32(1) / np.float32(c.size))
    c = c.sort()
    probs = probs_f32(c.logits)
    probs = probs[probs > 0]
    entropy = -np.float32(float((probs * torch.log(probs)).sum()))
    norm = entropy / max_entropy
    return scale(c, float(lo + (hi - lo) * np.power(norm, np.float32(exponent))))


def dist(c: Cands, rng: Mt19937) -> int:
    """The draw: the first candidate (in their order) whose running mass reaches u * total."""
    cum = torch.cumsum(torch.softmax(c.logits.double(), 0), 0)
    u = rng.uniform() * float(cum[-1])
    i = int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64)))
    return c.token(min(i, c.size - 1))
