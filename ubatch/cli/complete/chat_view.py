"""What the chat shows: the startup panel, the streamed answer, the speeds, /stats, the prefill bar.

The memory rows come from cli.memory_view, so the panel and /stats say what `ubatch info` says;
this module adds only what a conversation knows (turns, cells in use, the template, sampling).
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ubatch.cli.common import err_console
from ubatch.cli.memory_view import Rows, model_size, summary_rows, total_row
from ubatch.engine.chat.template import ChatTemplate
from ubatch.engine.completion.conversation import ChatSession, TurnStats
from ubatch.engine.context.report import MemoryPlan

COMMANDS: Rows = [
    ("/exit", "leave (also /quit or Ctrl-D)"),
    ("/clear", "start over: forget the conversation and empty the KV cache"),
    ("/stats", "context used, KV cache cells, memory, speeds, the last turn's tokens"),
    ("/regen", "answer the last message again"),
    ("/template NAME|FILE", "switch the chat template (a llama.cpp built-in name or a Jinja file)"),
    ("/help", "this list"),
]
HINT = "/exit /clear /stats /regen /template /help · Ctrl-C stops an answer · Ctrl-D leaves · Alt-Enter or a trailing \\ starts a new line"


class PrefillProgress:
    """A transient bar, ubatches done / total, for a prefill that takes longer than a second."""

    def __init__(self, console: Console, enabled: bool, after_s: float = 1.0) -> None:
        self.console, self.enabled, self.after_s = console, enabled, after_s
        self.t0 = time.perf_counter()
        self.bar: Any = None
        self.task: Any = None
        self.calls: list[tuple[int, int]] = []

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total))
        if not self.enabled:
            return
        if self.bar is None:
            if done >= total or time.perf_counter() - self.t0 < self.after_s:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("prefill"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("ubatches"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("prefill", total=total)
        self.bar.update(self.task, completed=done, total=total)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def startup_rows(
    ctx: Any,
    plan: MemoryPlan,
    template: ChatTemplate,
    sampler: Any,
    load_ms: float,
    system: str | None = None,
    n_predict: int = -1,
) -> Rows:
    """The startup log, compact: (label, text) rows for the panel (or plain lines)."""
    m, cp, hp = ctx.model, ctx.cparams, ctx.model.hparams
    rows = [
        ("model", f"{m.name} · {hp.arch} · {model_size(plan)} · {m.path.name} · loaded in {load_ms / 1e3:.1f} s"),
        (
            "context",
            f"n_ctx {cp.n_ctx} · n_ctx_seq {cp.n_ctx_seq} (trained {hp.n_ctx_train}) · "
            f"n_batch {cp.n_batch} · n_ubatch {cp.n_ubatch} · n_seq_max {cp.n_seq_max} · "
            f"{cp.n_threads} threads",
        ),
        *summary_rows(plan),
        ("template", template.describe),
    ]
    p = sampler.params
    samp = (
        "greedy (temp 0)"
        if p.temp <= 0
        else (f"temp {p.temp:g} · top-k {p.top_k} · top-p {p.top_p:g} · min-p {p.min_p:g}")
    )
    n_pred = "until end of turn" if n_predict < 0 else f"at most {n_predict} tokens"
    rows.append(("sampling", f"{samp} · seed {sampler.seed} · {n_pred}"))
    if system:
        rows.append(("system", system if len(system) < 80 else system[:77] + "..."))
    rows += [("warning", w) for w in [*m.vocab.warnings, *plan.warnings]]
    return rows


def stats_rows(session: ChatSession, plan: MemoryPlan) -> Rows:
    """/stats: the conversation and the last turn, the cells in use, then the plan's total."""
    ctx, ts = session.ctx, session.last
    n_ctx, used = session.n_ctx, len(session.tokens)
    rows = [
        (
            "conversation",
            f"turns: {session.turns} · messages: {len(session.messages)} · {used} / {n_ctx} tokens in the KV cache ({100 * used / n_ctx:.1f} %)",
        )
    ]
    if ts is not None:
        rows.append(
            (
                "last turn",
                f"prompt tokens evaluated last turn: {ts.n_prompt} · reused from the "
                f"KV cache: {ts.n_reused} · new turn tokens: {ts.n_turn} · "
                f"generated: {ts.n_gen} · stop: {ts.stop_reason}",
            )
        )
        rows.append(
            (
                "speed",
                f"prompt {ts.prompt_tps:.1f} t/s ({ts.n_prompt} tokens in "
                f"{ts.t_prompt_ms:.0f} ms) · generation {ts.eval_tps:.1f} t/s "
                f"({ts.n_eval} tokens in {ts.t_eval_ms:.0f} ms)",
            )
        )
        if ts.reprocess:
            rows.append(("note", f"whole conversation prefilled: {ts.reprocess}"))
    else:
        rows.append(("last turn", "none yet"))
    cells = [
        f"{(c.name + ': ') if c.name else ''}{c.used} / {c.size * c.n_stream} cells used" for c in ctx.memory.caches
    ]
    rows.append(("KV cache", " · ".join(cells)))
    rows.append(total_row(plan))
    rows.append(
        (
            "session",
            f"{session.n_generated} tokens generated · graphs reused {ctx.perf.graphs_reused} · ubatches run {ctx.perf.n_ubatch}",
        )
    )
    return rows


def _grid(rows: Rows) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    for k, v in rows:
        t.add_row(k, Text(v))
    return t


class ChatUI:
    """The two consoles of a chat: answers and notes on stdout, logs and errors on stderr."""

    def __init__(self, simple_io: bool, color: str = "auto") -> None:
        self.plain = simple_io
        no_color = simple_io or color == "off"  # -co off / on / auto (a terminal), as llama-cli
        force = False if simple_io else (True if color == "on" else None)
        self.out = Console(highlight=False, soft_wrap=True, no_color=no_color or None, force_terminal=force)
        self.err = (
            err_console
            if not simple_io
            else Console(stderr=True, highlight=False, no_color=True, force_terminal=False, soft_wrap=True)
        )
        self._at_line_start = True

    # messages
    def error(self, msg: str) -> None:
        self.err.print(Text.assemble(("error: ", "bold red"), msg), soft_wrap=True)

    def info(self, msg: str, style: str = "dim") -> None:
        self.out.print(Text(msg, style=style), soft_wrap=True)

    def log(self, msg: str) -> None:
        self.err.print(msg, markup=False, highlight=False, soft_wrap=True)

    def rows(self, rows: Rows, title: str | None = None, to_err: bool = False) -> None:
        """Label/text rows: a panel (with a title) or a grid on a terminal, plain lines otherwise."""
        console = self.err if to_err else self.out
        if self.plain or not console.is_terminal:
            for k, v in rows:
                console.print(f"{k:<12} {v}", markup=False, highlight=False, soft_wrap=True)
        elif title:
            console.print(Panel(_grid(rows), title=title, title_align="left", expand=False))
        else:
            console.print(_grid(rows))

    # the answer
    def piece(self, text: str) -> None:
        self.out.print(Text(text, style="cyan"), end="", soft_wrap=True)
        self.out.file.flush()
        self._at_line_start = text.endswith("\n")

    def end_answer(self) -> None:
        if not self._at_line_start:
            self.out.print()
        self._at_line_start = True

    def timings(self, ts: TurnStats) -> None:
        self.info(f"[ Prompt: {ts.prompt_tps:.1f} t/s | Generation: {ts.eval_tps:.1f} t/s ]")
