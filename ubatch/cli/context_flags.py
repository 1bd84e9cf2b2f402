"""The context flags (-c -b -ub -np -kvu --swa-full -ctk -ctv -t --backend), declared once for
every command that builds a context (`ubatch cli`, `server`, `explain`, `info`) and translated
once into the engine's `ContextParams`, so each command sizes a context the same way;
`context_params` serves the benchmarks and the draft model, whose values come from elsewhere.

The values are checked before anything loads (cli/validate.py); llama.cpp's clamps and rounding
stay the engine's (`engine.params.derive`), so `ubatch explain` can show each of them firing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ubatch.cli import validate
from ubatch.cli.flag_group import Refine, flag_group, shared_flag

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping
    from typing import Any

    from ubatch.engine.params import ContextParams
    from ubatch.engine.spec.speculative import SpecParams


@dataclass
class ContextFlags:
    """The flags as typed, with llama.cpp's names and defaults (llama-cli's where tools differ)."""

    ctx_size: int = shared_flag("ctx_size", 0)
    batch_size: int = shared_flag("batch_size", 2048)
    ubatch_size: int = shared_flag("ubatch_size", 512)
    parallel: int = shared_flag("parallel", 1)
    kv_unified: bool = shared_flag("kv_unified", False)
    swa_full: bool = shared_flag("swa_full", False)
    ctk: str = shared_flag("ctk", validate.DEFAULT_KV_TYPE)
    ctv: str = shared_flag("ctv", validate.DEFAULT_KV_TYPE)
    threads: int = shared_flag("threads", -1)
    backend: str = shared_flag("backend", "auto")

    def check(self, parallel_auto: bool = False) -> None:
        """Every value in range; the checks that import the engine's tables (-np's maximum, the KV
        types, the backends) come last, so a typo elsewhere answers before they load."""
        validate.context_flags(self.ctx_size, self.batch_size, self.ubatch_size, self.threads)
        validate.n_parallel(self.parallel, auto=parallel_auto)
        validate.kv_types(self.ctk, self.ctv)
        validate.backend(self.backend)

    def params(
        self,
        *,
        n_outputs_max: int | None = None,
        spec: SpecParams | None = None,
        embedding: bool = False,
        parallel: int | None = None,
    ) -> ContextParams:
        """These flags as `ContextParams` (see `context_params`); `parallel` overrides -np where the
        command resolved it (the server's -np -1, explain's one slot per prompt)."""
        return context_params(
            ctx_size=self.ctx_size,
            batch_size=self.batch_size,
            ubatch_size=self.ubatch_size,
            parallel=self.parallel if parallel is None else parallel,
            kv_unified=self.kv_unified,
            swa_full=self.swa_full,
            ctk=self.ctk,
            ctv=self.ctv,
            threads=self.threads,
            backend=self.backend,
            n_outputs_max=n_outputs_max,
            spec=spec,
            embedding=embedding,
        )


def context_options(
    refined: Mapping[str, Refine] | None = None, omit: Collection[str] = (), panel: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`@context_options(...)`: the flags added to a command, handed to it as `context: ContextFlags`."""
    return flag_group(ContextFlags, "context", refined, omit, panel)


def context_params(
    *,
    ctx_size: int = 0,
    batch_size: int = 2048,
    ubatch_size: int = 512,
    parallel: int = 1,
    kv_unified: bool = False,
    swa_full: bool = False,
    ctk: str = "f16",
    ctv: str = "f16",
    threads: int = 0,
    backend: str = "auto",
    n_outputs_max: int | None = None,
    spec: SpecParams | None = None,
    embedding: bool = False,
) -> ContextParams:
    """`ContextParams` for a command's flags, llama.cpp's defaults where a command has no flag.

    threads <= 0 means every core (-t -1). n_outputs_max None reserves one output row per
    sequence (llama-server's choice, ubatch's default); 0 means n_batch (llama-completion's and
    llama-bench's). With speculation (`spec`) each sequence also gets a row per drafted token.
    With embeddings every row of a batch is an output, and n_batch is cut to n_ubatch as
    llama-server does (its caller says so in the log). Rows never exceed -b: a batch holds no more.
    """
    from ubatch.engine.params import ContextParams  # here, not at import: --help stays quick

    if embedding:
        batch_size = min(batch_size, ubatch_size or batch_size)
        rows = batch_size
    else:
        rows = parallel if n_outputs_max is None else n_outputs_max
        if spec is not None:
            rows = spec.n_outputs_max(rows, parallel)
    return ContextParams(
        n_ctx=ctx_size,
        n_batch=batch_size,
        n_ubatch=ubatch_size,
        n_seq_max=parallel,
        n_threads=max(threads, 0),
        n_outputs_max=min(batch_size, rows),
        type_k=ctk,
        type_v=ctv,
        kv_unified=kv_unified,
        swa_full=swa_full,
        backend=backend,
    )
