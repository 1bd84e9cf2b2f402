"""`ubatch explain` drawn with Rich: the parameter derivation, the decode calls and their
ubatches (one character per row, coloured by sequence), n_kv and its padding, the mask grid
(cli/explain/mask_view.py), the memory plan (cli/memory_view.py) and the -ub what-if."""

from __future__ import annotations

from math import ceil

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from ubatch.cli.explain.json_view import rows_by_seq
from ubatch.cli.explain.mask_view import mask_section
from ubatch.cli.explain.run import Explanation
from ubatch.cli.explain.whatif import WhatIf
from ubatch.cli.memory_view import plan_table, size
from ubatch.engine.batch import RowKind
from ubatch.engine.explain.observer import CacheUse, UBatchView
from ubatch.engine.spec.speculative import SpecStats

SEQ_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
DIAGRAM_WIDTH = 20
KINDS = {RowKind.PROMPT: "prompt", RowKind.GENERATED: "generated", RowKind.DRAFTED: "drafted"}


def seq_style(s: int) -> str:
    return f"bold {SEQ_COLOURS[s % len(SEQ_COLOURS)]}"


def params_section(e: Explanation) -> RenderableType:
    """The values the context runs with, then each rule of derive that changed one."""
    cp = e.cparams
    head = Text.assemble(
        ("parameters", "bold"),
        f": n_ctx {cp.n_ctx}, n_ctx_seq {cp.n_ctx_seq}, n_batch {cp.n_batch}, n_ubatch {cp.n_ubatch}, "
        f"n_seq_max {cp.n_seq_max}{' (unified KV)' if cp.kv_unified else ''}\n"
        f"  n_outputs_max {cp.n_outputs_max}; {e.n_slots} slot(s), each holds {e.n_ctx_slot} tokens",
    )
    lines: list[RenderableType] = [head]
    for s in cp.steps:
        lines.append(Text.assemble("  ", (f"{s.name} {s.given} -> {s.value}", "bold"), f" because {s.rule}"))
    if not cp.steps:
        lines.append(Text("  every value as given: no clamp or rounding fired"))
    lines += [Text(f"  warning: {w}", style="yellow") for w in e.warnings]
    return Group(*lines)


def diagram(u: UBatchView, width: int = DIAGRAM_WIDTH) -> Text:
    """One character per row (its kind), coloured by its sequence; a wide ubatch is drawn with
    one character per `k` rows (the first row of each group), followed by `xk`."""
    k = max(1, ceil(u.n_tokens / width))
    t = Text()
    for i in range(0, u.n_tokens, k):
        t.append(u.row_kind[i], style=seq_style(u.row_seq[i][0]))
    if k > 1:
        t.append(f" x{k}", style="dim")
    return t


def seq_summary(u: UBatchView) -> Text:
    t = Text()
    for i, (s, kinds) in enumerate(rows_by_seq(u).items()):
        if i:
            t.append(" ")
        t.append(f"s{s}", style=seq_style(int(s)))
        t.append(":" + ",".join(f"{n}{k}" for k, n in kinds.items()))
        if u.loras.get(int(s)):  # the LoRA adapters its rows applied, as id@scale
            t.append("+lora " + ",".join(f"{i}@{v:g}" for i, v in u.loras[int(s)]), style="dim")
    return t


def kv_cell(uses: list[CacheUse]) -> str:
    """n_kv = one past the last used cell + the padding to the 256 quantum; for a group of
    alike ubatches, n_kv and the range of cells used."""
    a, b = uses[0], uses[-1]
    if len(uses) == 1:
        return f"{a.n_kv} = {a.used_max_p1}+{a.pad}"
    return f"{a.n_kv}, {a.used_max_p1}-{b.used_max_p1} used"


def _span(a: int, b: int) -> str:
    return str(a + 1) if a == b else f"{a + 1}-{b + 1}"


def groups(ubs: list[UBatchView]) -> list[list[UBatchView]]:
    """Consecutive ubatches alike in all but the cells in use and the graph's reuse (a prompt's
    equal pieces, a generation's steps), as one line."""

    def key(u: UBatchView) -> tuple:
        return (u.n_tokens, u.row_kind, tuple(map(tuple, u.row_seq)), tuple(k.n_kv for k in u.kv))

    out: list[list[UBatchView]] = []
    for u in ubs:
        if out and key(out[-1][-1]) == key(u) and u.call - out[-1][-1].call <= 1:
            out[-1].append(u)
        else:
            out.append([u])
    return out


def graph_cell(g: list[UBatchView]) -> str:
    n_new = sum(not u.reused for u in g)
    if n_new in (0, len(g)):
        return "new" if n_new else "reused"
    return "new, reused" if n_new == 1 and not g[0].reused else f"{n_new} new"


def calls_section(e: Explanation) -> RenderableType:
    ubs = [u for c in e.calls for u in c.ubatches]
    names = [k.cache for k in ubs[0].kv] if ubs else []
    t = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        title=f"{len(e.calls)} decode calls, {len(ubs)} ubatches (forward passes)",
        title_justify="left",
        caption="rows: p prompt, g generated, d drafted, coloured by sequence (s0, s1, ...); "
        "n_kv = cells attended = last used cell + padding to a multiple of 256; "
        "graph: a new shape, or the previous one reused",
        caption_justify="left",
    )
    t.add_column("call", justify="right")
    t.add_column("ub", justify="right")
    t.add_column("rows", justify="right")
    t.add_column("a char per row", no_wrap=True)
    t.add_column("sequences")
    for n in names:
        t.add_column(f"n_kv {n}" if len(names) > 1 else "n_kv", justify="right", no_wrap=True)
    t.add_column("graph")
    for g in groups(ubs):
        a, b = g[0], g[-1]
        row: list[RenderableType] = [_span(a.call, b.call), _span(a.index, b.index), str(a.n_tokens)]
        row += [diagram(a), seq_summary(a)]
        row += [kv_cell([u.kv[i] for u in g]) for i in range(len(names))]
        row.append(graph_cell(g))
        t.add_row(*row)
    return t


def what_if_section(e: Explanation) -> RenderableType:
    t = Table(title="what if -ub were ... (the same calls, re-split; sizes from the planner)", title_justify="left")
    for c in ("-ub", "n_ubatch", "forward passes", "compute buffer", "KV cache", "total", "note"):
        t.add_column(c, justify="left" if c == "note" else "right")
    for w in e.what_if:
        t.add_row(
            str(w.n_ubatch_asked),
            str(w.n_ubatch),
            str(w.n_passes) if w.n_passes >= 0 else "does not fit",
            size(w.compute_bytes),
            size(w.kv_bytes),
            size(w.total_bytes),
            note(w),
            style="bold" if w.given else "",
        )
    return t


def note(w: WhatIf) -> str:
    parts = ["this run"] if w.given else []
    if w.rule:
        parts.append(f"clamped: {w.rule}")
    if w.error:
        parts.append(w.error)
    return "; ".join(parts)


def sequences_line(e: Explanation) -> Text:
    t = Text()
    t.append("request", style="bold")
    t.append(f": {len(e.sequences)} sequence(s) on {e.n_slots} slot(s):")
    for i, s in enumerate(e.sequences):
        t.append(" " if i == 0 else ", ")
        t.append(f"s{s.slot}", style=seq_style(s.slot))
        t.append(f" {s.n_prompt} prompt")
        if s.n_shared:
            t.append(f" ({s.n_shared} shared from ")
            t.append(f"s{s.shared_from}", style=seq_style(s.shared_from))
            t.append(")")
        elif s.n_cached:
            t.append(f" ({s.n_cached} cached)")
        t.append(f" + {s.n_generated} generated")
    if e.n_cells_shared:
        t.append(f"; {e.n_cells_shared} KV cells shared")
    return t


def verdict(e: Explanation) -> Text:
    """Why the compute buffer is this size, and the smallest -ub that costs no extra pass."""
    p, given = e.plan, next(w for w in e.what_if if w.given)
    largest = max((u.n_tokens for c in e.calls for u in c.ubatches), default=0)
    t = Text.assemble(
        ("compute buffer", "bold"),
        f" {size(p.compute_bytes)}: reserved for a {p.worst_case[0]}-token ubatch over the full KV; "
        f"this request's largest ubatch had {largest} rows.",
    )
    same = [w for w in e.what_if if w.n_passes == given.n_passes and w.compute_bytes < given.compute_bytes]
    if same:
        w = min(same, key=lambda w: w.compute_bytes)
        t.append(f" -ub {w.n_ubatch_asked} would take the same {w.n_passes} passes in {size(w.compute_bytes)}.")
    return t


def spec_line(e: Explanation, st: SpecStats) -> Text:
    """Speculative decoding: the drafts, and the passes their verification took."""
    ub = e.cparams.n_ubatch
    drafted = [c for c in e.calls if RowKind.DRAFTED in c.batch.kind]
    t = Text.assemble(
        ("speculative", "bold"),
        f": {st.n_drafts} drafts, {st.n_drafted} tokens drafted, {st.n_accepted} accepted; "
        f"the {len(drafted)} calls with drafted rows took {sum(len(c.ubatches) for c in drafted)} forward passes",
    )
    longest = max((c.batch.kind.count(RowKind.DRAFTED) for c in drafted), default=0)
    if longest + 1 > ub:
        t.append(f" (a {longest}-token draft and its sampled row are {longest + 1} rows: more than -ub {ub})")
    return t


def render(e: Explanation, console: Console) -> None:
    """The whole explanation, section by section."""
    console.print(sequences_line(e))
    console.print(params_section(e))
    console.print(calls_section(e))
    if e.spec is not None:
        console.print(spec_line(e, e.spec))
    for part in mask_section(e):
        console.print(part)
    console.print(plan_table(e.plan))
    console.print(what_if_section(e))
    console.print(verdict(e))
