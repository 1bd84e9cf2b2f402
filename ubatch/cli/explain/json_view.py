"""`ubatch explain --json`: the Explanation as JSON-ready data, the same content the Rich view
draws (cli/explain/view.py), for scripts and `ubatch bench`."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ubatch.cli.explain.run import Explanation
from ubatch.cli.memory_view import plan_json
from ubatch.engine.explain.mask import REASONS, MaskGrid
from ubatch.engine.explain.observer import CallView, UBatchView


def ubatch_json(u: UBatchView) -> dict[str, Any]:
    d = asdict(u)
    for k, c in zip(d["kv"], u.kv):
        k["pad"] = c.pad
    d["rows_by_seq"] = rows_by_seq(u)
    return d


def rows_by_seq(u: UBatchView) -> dict[str, dict[str, int]]:
    """{"0": {"p": 6, "g": 1}, ...}: a ubatch's rows counted by sequence and kind."""
    out: dict[str, dict[str, int]] = {}
    for sids, k in zip(u.row_seq, u.row_kind):
        for s in sids:
            per = out.setdefault(str(s), {})
            per[k] = per.get(k, 0) + 1
    return out


def call_json(c: CallView) -> dict[str, Any]:
    b = c.batch
    return {
        "index": c.index,
        "n_tokens": c.n_tokens,
        "n_outputs": c.n_outputs,
        "row_seq": [list(s) for s in b.seq_id],
        "row_kind": "".join(b.kind_of(i) for i in range(b.n_tokens)),
        "ubatches": [ubatch_json(u) for u in c.ubatches],
    }


def mask_json(g: MaskGrid) -> dict[str, Any]:
    d = asdict(g)
    d["reasons"] = list(REASONS)  # codes index this list
    return d


def explanation_json(e: Explanation) -> dict[str, Any]:
    cp = e.cparams
    return {
        "params": asdict(e.params),
        "effective": {
            "n_ctx": cp.n_ctx,
            "n_ctx_seq": cp.n_ctx_seq,
            "n_ctx_slot": e.n_ctx_slot,
            "n_batch": cp.n_batch,
            "n_ubatch": cp.n_ubatch,
            "n_seq_max": cp.n_seq_max,
            "n_outputs_max": cp.n_outputs_max,
            "kv_unified": cp.kv_unified,
            "n_slots": e.n_slots,
        },
        "derivation": [asdict(s) for s in cp.steps],
        "warnings": e.warnings,
        "sequences": [asdict(s) for s in e.sequences],
        "n_decode": len(e.calls),
        "n_ubatch": e.n_ubatches,
        "calls": [call_json(c) for c in e.calls],
        "mask": {"ubatch": e.mask_ubatch, "caches": [mask_json(g) for g in e.mask]},
        "memory": plan_json(e.plan),
        "what_if": [asdict(w) for w in e.what_if],
        "speculative": asdict(e.spec) if e.spec is not None else None,
    }
