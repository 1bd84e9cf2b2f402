"""What speculative decoding reports: at start, the drafters, their caps, the draft model's
memory and the output rows reserved for verification; at the end, llama.cpp's acceptance line
and the forward passes the verifications took (where -ub below the draft's rows costs a pass)."""

from __future__ import annotations

from typing import Any

from ubatch.cli.memory_view import size


def spec_startup_lines(spec: Any, ctx: Any) -> list[str]:
    """The speculator's set-up, in the startup log."""
    if spec is None:
        return []
    caps = ", ".join(f"{d.name} (n_max = {d.n_max})" for d in spec.drafters)
    cp = ctx.cparams
    lines = [
        f"speculative: drafters = {caps}; verification rows per step up to 1 + {spec.n_max}",
        f"speculative: n_outputs_max = {cp.n_outputs_max}, n_ubatch = {cp.n_ubatch}"
        + (
            f" (a {spec.n_max}-token draft needs {-(-(1 + spec.n_max) // cp.n_ubatch)} forward passes)"
            if 1 + spec.n_max > cp.n_ubatch
            else ""
        ),
    ]
    for d in spec.drafters:
        dctx = getattr(d, "ctx", None)
        if dctx is not None:
            from ubatch.engine.context.report import memory_plan

            p = memory_plan(dctx)
            lines.append(
                f"speculative: draft model {p.model_file}: weights {size(p.model_bytes + p.backend_bytes)}, "
                f"KV {size(p.kv_bytes)}, compute buffer {size(p.compute_bytes)}, output buffer {size(p.output_bytes)}"
            )
    return lines


def spec_summary_lines(st: Any) -> list[str]:
    """llama-server's slot-end line, the acceptance per draft position, and the passes per verification."""
    if st.n_drafts == 0:
        return []
    acc = ", ".join(f"{r:.3f}" for r in st.per_position())
    return [
        f"draft acceptance = {st.acceptance:0.5f} ({st.n_accepted:5d} accepted / {st.n_drafted:5d} generated), "
        f"mean len = {st.mean_len:5.2f}",
        f"     acc per pos = ({acc})",
        f"     verifications = {st.n_drafts}, forward passes = {st.n_verify_ubatches} "
        f"({st.n_verify_ubatches / st.n_drafts:.2f} per verification)"
        + (f", {st.t_verify_ms / st.n_drafts:.2f} ms per verification" if st.t_verify_ms else ""),
    ]
