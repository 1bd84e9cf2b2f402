"""A request's logit biases (ignore_eos's -inf on every end-of-generation token among them),
added to a logits row for the length of one draw."""

from __future__ import annotations

import numpy as np
import torch


class LogitBias:
    """Token ids and the values added to their logits, in order (a repeated id adds up), as
    float32 values for the host and tensors for a device; built once per request."""

    __slots__ = ("ids", "values", "_ids_t", "_values_t", "id_set", "lowers_only")

    def __init__(self, pairs: list[tuple[int, float]]) -> None:
        self.ids = [int(t) for t, _ in pairs]
        self.values = [np.float32(b) for _, b in pairs]
        self.id_set = frozenset(self.ids)
        # every bias lowers (ignore_eos's -inf): a row's argmax outside `ids` is the biased row's too
        self.lowers_only = all(v <= 0 for v in self.values)
        self._ids_t = torch.tensor(self.ids, dtype=torch.long)
        self._values_t = torch.tensor([float(v) for v in self.values], dtype=torch.float32)

    def on(self, x: torch.Tensor) -> Biased:
        return Biased(x, self)


# more biased tokens than this are added by one numpy call; fewer (ignore_eos's few end-of-
# generation tokens) one by one, which costs less than setting up a call
N_BIAS_LOOP = 16


class Biased:
    """A logits row with biases added (repeated tokens add up) while inside the `with`, as
    llama.cpp's logit-bias sampler. On the CPU the row itself is changed, through numpy, and
    its values at the biased tokens are put back on leaving: no copy of the vocabulary per
    token (a 262k row is 1 MB), and no torch scatter, whose parallel copy waits for a second
    thread that a busy machine may not schedule for milliseconds (15-20 ms measured for
    ignore_eos's 3 biases with the CPUs shared). Elsewhere, a new row."""

    __slots__ = ("row", "_bias", "_saved", "_np")

    def __init__(self, x: torch.Tensor, bias: LogitBias) -> None:
        self._saved: list[np.float32] | np.ndarray | None = None
        self._bias = bias
        if x.device.type != "cpu":
            self.row = x.index_put((bias._ids_t.to(x.device),), bias._values_t.to(x.device), accumulate=True)
            return
        self.row, self._np = x, x.numpy()
        row, ids = self._np, bias.ids
        if len(ids) <= N_BIAS_LOOP:
            self._saved = [row[i] for i in ids]
            for i, v in zip(ids, bias.values):
                row[i] += v
        else:
            self._saved = row[ids]
            np.add.at(row, ids, np.array(bias.values, dtype=np.float32))

    def __enter__(self) -> torch.Tensor:
        return self.row

    def __exit__(self, *exc: object) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        if isinstance(saved, list):
            row = self._np
            for i, v in zip(self._bias.ids, saved):
                row[i] = v
        else:
            self._np[self._bias.ids] = saved
