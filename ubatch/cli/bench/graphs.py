"""`ubatch bench` on the cuda backend: CUDA-graph captures and replays per test.

llama-bench's output formats stay column for column, so these lines go to stderr after the
results. The counts come from the process-wide tally of kernels/cuda/graphs.py, read at the end
of each test (the bench's "done" event), so no bench record needs a new field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ubatch.cli.bench.params import BenchTest
from ubatch.cli.bench.result import BenchEvent
from ubatch.kernels.cuda import graphs as cuda_graphs
from ubatch.kernels.ops import GraphCounters


@dataclass
class GraphTally:
    label: str = ""  # the running test's label (from its warm-up / repetition events)
    rows: list[tuple[str, GraphCounters]] = field(default_factory=list)
    _before: GraphCounters = field(default_factory=lambda: replace(cuda_graphs.TOTALS))

    def on_event(self, e: BenchEvent, label_of: Callable[[BenchTest], str]) -> None:
        if e.kind in ("warmup", "rep") and e.test is not None:
            self.label = label_of(e.test)
        elif e.kind == "done":
            now = replace(cuda_graphs.TOTALS)
            self.rows.append((self.label, now.since(self._before)))
            self._before = now

    def lines(self) -> list[str]:
        """One line per test ('off' where no step went through a graph runner)."""
        return [f"{label}: {cuda_graphs.summary(c)}" for label, c in self.rows]
