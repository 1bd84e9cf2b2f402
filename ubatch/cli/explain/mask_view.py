"""The KQ mask of one small ubatch as a grid: query rows x cells, a character per cell saying
whether the row sees it and, if not, why (engine/explain/mask.py classifies; this draws)."""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text

from ubatch.cli.explain.run import Explanation
from ubatch.engine.explain.mask import EMPTY, FUTURE, OTHER_SEQ, REASONS, VISIBLE, WINDOW, MaskGrid
from ubatch.engine.explain.observer import MASK_MAX_ROWS

MAX_CELLS = 60  # wider grids show their last MAX_CELLS cells (the ones next to the queries)
GLYPH = {VISIBLE: ("#", "bold green"), EMPTY: (".", "dim"), OTHER_SEQ: ("o", "magenta")}
GLYPH |= {FUTURE: ("f", "yellow"), WINDOW: ("w", "blue")}


def legend() -> Text:
    t = Text("  ")
    for code in (VISIBLE, EMPTY, OTHER_SEQ, FUTURE, WINDOW):
        ch, style = GLYPH[code]
        t.append(ch, style=style)
        t.append(f" {REASONS[code]}   ")
    return t


def grid_lines(g: MaskGrid) -> list[Text]:
    """Per sequence group: a cell-index ruler, then one line per query row."""
    lo = max(g.first_cell, g.n_cells - MAX_CELLS)
    per = len(g.row_seq) // len(g.codes)
    label_w = 20
    out: list[Text] = []
    for gi, rows in enumerate(g.codes):
        if len(g.codes) > 1:
            out.append(Text(f"  stream {g.streams[gi]}", style="bold"))
        tens = "".join(str(c // 10 % 10) if c % 10 == 0 else " " for c in range(lo, g.n_cells))
        units = "".join(str(c % 10) for c in range(lo, g.n_cells))
        out.append(Text(" " * label_w + tens, style="dim"))
        out.append(Text(f"{'cell':>{label_w - 1}} " + units, style="dim"))
        for r, codes in enumerate(rows):
            i = gi * per + r
            t = Text(f"  s{g.row_seq[i]} pos {g.row_pos[i]:<5} {g.row_kind[i]:<2}".ljust(label_w))
            for code in codes[lo - g.first_cell :]:
                ch, style = GLYPH[code]
                t.append(ch, style=style)
            out.append(t)
    return out


def mask_section(e: Explanation) -> list[RenderableType]:
    """The chosen ubatch's mask for each cache (once when the caches agree)."""
    if not e.mask:
        return [Text(f"mask: no ubatch of at most {MASK_MAX_ROWS} rows in this run to draw", style="dim")]
    shown: list[MaskGrid] = []
    for g in e.mask:
        same = next((s for s in shown if s.codes == g.codes and s.cell_pos == g.cell_pos), None)
        if same is not None:
            same.cache += f" and {g.cache}"
        else:
            shown.append(MaskGrid(**{k: getattr(g, k) for k in g.__slots__}))  # a copy to rename
    out: list[RenderableType] = []
    for g in shown:
        first = max(0, g.n_cells - MAX_CELLS)
        pad = f"; cells {g.n_cells}-{g.n_kv - 1} of n_kv {g.n_kv}: empty (padding)" if g.n_kv > g.n_cells else ""
        cut = f" (cells {first}-{g.n_cells - 1} shown)" if first else ""
        out.append(Text(f"mask of ubatch {e.mask_ubatch + 1}, {g.cache} cache", style="bold"))
        out.append(Text(f"  {len(g.row_seq)} query rows x {g.n_cells} used cells{cut}{pad}"))
        out += grid_lines(g)
    out.append(legend())
    return out
