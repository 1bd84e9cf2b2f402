"""The context flags (-c -b -ub -np -kvu --swa-full -ctk -ctv -t --backend --n-outputs-max) as the
engine's `ContextParams`: one translation for every command, so `ubatch cli`, `server`, `explain`,
`info`, `bench`, `batched-bench` and a draft model's context size a context the same way.

The values arrive checked (cli/validate.py); llama.cpp's clamps and rounding stay the engine's
(`engine.params.derive`), so `ubatch explain` can show each of them firing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ubatch.engine.params import ContextParams
    from ubatch.engine.spec.speculative import SpecParams


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
    # the engine (and torch) load here, not at import: a typo in a flag is answered at once
    from ubatch.engine.params import ContextParams

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
