"""`ubatch cli` without -p (or with -cnv): a conversation in the terminal.

What it shows: the startup log as a compact panel (or llama.cpp's lines with --verbose), the
answers streamed, `[ Prompt: X t/s | Generation: Y t/s ]` after each answer like llama-cli,
a progress bar for a prefill longer than a second, and /stats. The conversation logic (chat
template, KV cache reuse between turns) is engine.chat.ChatSession; this module reads input and
prints.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..engine.chat import ChatInputError, ChatSession, TurnStats
from ..engine.chat_template import ChatTemplate, ChatTemplateError
from ..engine.errors import UbatchError
from .common import err_console

MiB = 1024 * 1024
COMMANDS = [
    ("/exit", "leave (also /quit or Ctrl-D)"),
    ("/clear", "start over: forget the conversation and empty the KV cache"),
    ("/stats", "context used, KV cache cells, memory, speeds, the last turn's tokens"),
    ("/regen", "answer the last message again"),
    ("/template NAME|FILE", "switch the chat template (gemma, chatml, llama3 or a Jinja file)"),
    ("/help", "this list"),
]
HINT = ("/exit /clear /stats /regen /template /help · Ctrl-C stops an answer · Ctrl-D leaves · "
        "Alt-Enter or a trailing \\ starts a new line")


@dataclass
class ChatOptions:
    system: str | None = None
    first_prompt: str | None = None
    single_turn: bool = False
    chat_template: str | None = None
    use_jinja: bool = True
    verbose: bool = False
    simple_io: bool = False
    log_disable: bool = False
    show_timings: bool = True
    n_predict: int = -1
    ignore_eos: bool = False
    context_shift: bool = False
    keep: int = 0


# -- input ----------------------------------------------------------------------------------------

def history_path() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ubatch" / "chat_history"


def prompt_toolkit_reader() -> Callable[[], str]:
    """Line editing, history (kept in history_path()), multi-line input: Enter sends, Alt-Enter
    (Esc Enter) or a trailing backslash starts a new line; pasted newlines stay in the message."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, History, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()

    @kb.add("enter")
    def _enter(event: Any) -> None:
        buf = event.current_buffer
        if buf.document.is_cursor_at_the_end and buf.text.endswith("\\"):
            buf.delete_before_cursor(1)
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    history: History
    try:
        path = history_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        history = FileHistory(str(path))
    except OSError:
        history = InMemoryHistory()
    session: PromptSession[str] = PromptSession(
        history=history, key_bindings=kb, multiline=True,
        prompt_continuation=lambda width, line, wrap: "." * (width - 1) + " ")
    return lambda: session.prompt("> ")


def plain_reader(echo: bool) -> Callable[[], str]:
    """input() with "> ": a trailing backslash continues on the next line. When stdin is not a
    terminal the lines read are echoed, so the transcript shows them."""

    def read() -> str:
        parts, marker = [], "> "
        while True:
            sys.stdout.write(marker)
            sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                if parts:
                    return "\n".join(parts)
                sys.stdout.write("\n")
                raise EOFError
            line = line.rstrip("\r\n")
            if echo:
                sys.stdout.write(line + "\n")
            if line.endswith("\\"):
                parts.append(line[:-1])
                marker = "... "
                continue
            parts.append(line)
            return "\n".join(parts)

    return read


# -- output ---------------------------------------------------------------------------------------

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

            self.bar = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("ubatches"), TimeElapsedColumn(), console=self.console,
                                transient=True)
            self.bar.start()
            self.task = self.bar.add_task("prefill", total=total)
        self.bar.update(self.task, completed=done, total=total)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _mib(n: int) -> str:
    return f"{n / MiB:.2f} MiB"


def startup_rows(ctx: Any, plan: Any, template: ChatTemplate, sampler: Any, opts: ChatOptions,
                 load_ms: float) -> list[tuple[str, str]]:
    """The startup log, compact: (label, text) rows for the panel (or plain lines)."""
    m, cp, hp = ctx.model, ctx.cparams, ctx.model.hparams
    rows = [("model", f"{m.name} · {hp.arch} · {plan.n_params / 1e6:.2f} M params · "
                      f"{_mib(plan.model_bytes)} ({8 * plan.model_bytes / plan.n_params:.2f} BPW) · "
                      f"{m.path.name} · loaded in {load_ms / 1e3:.1f} s")]
    rows.append(("context", f"n_ctx {cp.n_ctx} · n_ctx_seq {cp.n_ctx_seq} (trained {hp.n_ctx_train}) · "
                            f"n_batch {cp.n_batch} · n_ubatch {cp.n_ubatch} · n_seq_max {cp.n_seq_max} · "
                            f"{cp.n_threads} threads"))
    kv = []
    for c in plan.kv:
        kv.append(f"{(c.name + ' ') if c.name else ''}{c.size} cells × {c.n_layer} layers = "
                  f"{_mib(c.k_bytes + c.v_bytes)}")
    kv_types = f"K {plan.kv[0].type_k} / V {plan.kv[0].type_v}" if plan.kv else ""
    rows.append(("KV cache", " · ".join(kv + [kv_types])))
    n, s, o = plan.worst_case
    peak = f"; largest: {plan.peak[0][0]} {list(plan.peak[0][1])} {_mib(plan.peak[0][2])}" if plan.peak else ""
    rows.append(("compute", f"{_mib(plan.compute_bytes)} for a {n}-token ubatch over the full KV "
                            f"(shrinks with -ub){peak}"))
    rows.append(("memory", f"{_mib(plan.total_bytes)} = model {plan.model_bytes / MiB:.2f} + backend "
                           f"{plan.backend_bytes / MiB:.2f} + KV {plan.kv_bytes / MiB:.2f} + output "
                           f"{plan.output_bytes / MiB:.2f} + compute {plan.compute_bytes / MiB:.2f}"))
    rows.append(("template", template.describe))
    p = sampler.params
    samp = "greedy (temp 0)" if p.temp <= 0 else (f"temp {p.temp:g} · top-k {p.top_k} · top-p {p.top_p:g} · "
                                                  f"min-p {p.min_p:g}")
    n_pred = "until end of turn" if opts.n_predict < 0 else f"at most {opts.n_predict} tokens"
    rows.append(("sampling", f"{samp} · seed {sampler.seed} · {n_pred}"))
    if opts.system:
        rows.append(("system", opts.system if len(opts.system) < 80 else opts.system[:77] + "..."))
    for w in cp.warnings:
        rows.append(("warning", w))
    return rows


class ChatUI:
    def __init__(self, opts: ChatOptions) -> None:
        self.opts = opts
        plain = opts.simple_io
        self.out = Console(highlight=False, soft_wrap=True, no_color=plain or None,
                           force_terminal=False if plain else None)
        self.err = err_console if not plain else Console(stderr=True, highlight=False, no_color=True,
                                                         force_terminal=False, soft_wrap=True)
        self._at_line_start = True

    # messages
    def error(self, msg: str) -> None:
        self.err.print(Text.assemble(("error: ", "bold red"), msg), soft_wrap=True)

    def info(self, msg: str, style: str = "dim") -> None:
        self.out.print(Text(msg, style=style), soft_wrap=True)

    def log(self, msg: str) -> None:
        self.err.print(msg, markup=False, highlight=False, soft_wrap=True)

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


def stats_lines(session: ChatSession, plan: Any) -> list[tuple[str, str]]:
    ctx, ts = session.ctx, session.last
    n_ctx = session.n_ctx
    used = len(session.tokens)
    rows = [("conversation", f"turns: {session.turns} · messages: {len(session.messages)} · "
                             f"{used} / {n_ctx} tokens in the KV cache ({100 * used / n_ctx:.1f} %)")]
    if ts is not None:
        rows.append(("last turn", f"prompt tokens evaluated last turn: {ts.n_prompt} · reused from the "
                                  f"KV cache: {ts.n_reused} · new turn tokens: {ts.n_turn} · "
                                  f"generated: {ts.n_gen} · stop: {ts.stop_reason}"))
        rows.append(("speed", f"prompt {ts.prompt_tps:.1f} t/s ({ts.n_prompt} tokens in "
                              f"{ts.t_prompt_ms:.0f} ms) · generation {ts.eval_tps:.1f} t/s "
                              f"({ts.n_eval} tokens in {ts.t_eval_ms:.0f} ms)"))
        if ts.reprocess:
            rows.append(("note", f"whole conversation prefilled: {ts.reprocess}"))
    else:
        rows.append(("last turn", "none yet"))
    cells = []
    for c in ctx.memory.caches:
        cells.append(f"{(c.name + ': ') if c.name else ''}{c.used} / {c.size * c.n_stream} cells used")
    rows.append(("KV cache", " · ".join(cells)))
    rows.append(("memory", f"KV {_mib(plan.kv_bytes)} · compute {_mib(plan.compute_bytes)} · output "
                           f"{_mib(plan.output_bytes)} · model {_mib(plan.model_bytes)} (+ {plan.backend} backend "
                           f"{_mib(plan.backend_bytes)}) · total {_mib(plan.total_bytes)}"))
    rows.append(("session", f"{session.n_generated} tokens generated · graphs reused "
                            f"{ctx.perf.graphs_reused} · ubatches run {ctx.perf.n_ubatch}"))
    return rows


def _grid(rows: list[tuple[str, str]]) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    for k, v in rows:
        t.add_row(k, Text(v))
    return t


# -- the loop -------------------------------------------------------------------------------------

class Chat:
    def __init__(self, session: ChatSession, ui: ChatUI, plan: Any, opts: ChatOptions) -> None:
        self.session, self.ui, self.plan, self.opts = session, ui, plan, opts
        self.can_progress = not opts.simple_io and not opts.log_disable and ui.err.is_terminal

    def show_rows(self, rows: list[tuple[str, str]], title: str | None = None, to_err: bool = False) -> None:
        console = self.ui.err if to_err else self.ui.out
        if self.opts.simple_io or not console.is_terminal:
            for k, v in rows:
                console.print(f"{k:<12} {v}", markup=False, highlight=False, soft_wrap=True)
        elif title:
            console.print(Panel(_grid(rows), title=title, title_align="left", expand=False))
        else:
            console.print(_grid(rows))

    def turn(self, text: str, regen: bool = False) -> None:
        s, ui = self.session, self.ui
        prog = PrefillProgress(ui.err, self.can_progress)
        try:
            it = s.regenerate(prog) if regen else s.respond(text, prog)
        except (ChatInputError, ChatTemplateError) as e:
            ui.error(str(e))
            return
        interrupted = False
        try:
            for piece in it:
                prog.stop()
                ui.piece(piece)
        except KeyboardInterrupt:
            interrupted = True
            close = getattr(it, "close", None)
            if close is not None:
                close()  # the session keeps what was decoded
        except UbatchError as e:
            prog.stop()
            ui.end_answer()
            ui.error(str(e))
            return
        finally:
            prog.stop()
        ui.end_answer()
        ts = s.last
        if ts is None:
            return
        if self.opts.verbose:
            ui.log(f"chat: formatted turn {ts.turn}: {json.dumps(ts.turn_text, ensure_ascii=False)}")
        if interrupted:
            ui.info("(answer interrupted)" if ts.n_past and ts.stop_reason == "interrupted" and ts.n_prompt
                    else "(interrupted before the answer started)")
        elif ts.stop_reason == "context":
            hint = "restart with a larger -c or with --context-shift"
            if self.opts.context_shift and not s.shift_in_answer:
                hint = "restart with a larger -c (shifting within an answer needs --swa-full for this model)"
            ui.info(f"context full ({s.n_ctx} tokens): the answer was cut; /clear to start over, or {hint}",
                    style="yellow")
        if ts.n_dropped:
            ui.info(f"(the conversation outgrew the context: dropped the {ts.n_dropped} oldest messages)",
                    style="yellow")
        if self.opts.verbose:
            ui.log(f"chat: turn {ts.turn}: {ts.n_prompt} prompt tokens evaluated, {ts.n_reused} reused from "
                   f"the KV cache, {ts.n_gen} generated (stop: {ts.stop_reason}), context "
                   f"{len(s.tokens)}/{s.n_ctx}" + (f"; reprocessed: {ts.reprocess}" if ts.reprocess else ""))
        if self.opts.show_timings and ts.n_prompt:
            ui.timings(ts)

    def command(self, line: str) -> bool:
        """Run a slash command; False means leave."""
        cmd, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        s, ui = self.session, self.ui
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/clear":
            s.clear()
            ui.info("conversation cleared: the KV cache is empty" + (" (the system prompt stays)" if s.system else ""))
        elif cmd == "/stats":
            self.show_rows(stats_lines(s, self.plan))
        elif cmd == "/help":
            self.show_rows(COMMANDS)
        elif cmd == "/regen":
            self.turn("", regen=True)
        elif cmd == "/template":
            if not arg:
                ui.info(f"chat template: {s.template.describe}; /template NAME|FILE to switch")
                return True
            try:
                t = ChatTemplate.for_model(s.ctx.model, override=arg, use_jinja=self.opts.use_jinja)
            except ChatTemplateError as e:
                ui.error(f"{e} (the chat template stays {s.template.name})")
                return True
            s.set_template(t)
            ui.info(f"chat template: {t.describe}")
        else:
            ui.error(f"unknown command {cmd}: type /help for the commands (start a message with // to "
                     "send a leading /)")
        return True

    def run(self, read: Callable[[], str]) -> None:
        opts, ui = self.opts, self.ui
        if opts.first_prompt is not None:
            ui.out.print(Text("> ", style="bold") + Text(opts.first_prompt), soft_wrap=True)
            self.turn(opts.first_prompt)
            if opts.single_turn:
                ui.info("Exiting...")
                return
        while True:
            try:
                line = read()
            except EOFError:
                break
            except KeyboardInterrupt:
                ui.info("(Ctrl-C stops an answer; Ctrl-D or /exit leaves)")
                continue
            if line.startswith("/") and not line.startswith("//"):
                if not self.command(line):
                    break
                continue
            if line.startswith("//"):
                line = line[1:]
            before = self.session.turns
            self.turn(line)
            if opts.single_turn and self.session.turns > before:
                break
        ui.info("Exiting...")


def run_chat(ctx: Any, sampler: Any, opts: ChatOptions, load_ms: float) -> None:
    """Start the conversation on a loaded, warmed-up context."""
    from ..engine.report import memory_plan
    from .present import breakdown_table, startup_lines

    template = ChatTemplate.for_model(ctx.model, override=opts.chat_template, use_jinja=opts.use_jinja)
    ui = ChatUI(opts)
    plan = memory_plan(ctx)
    session = ChatSession(ctx, template, sampler, system=opts.system, n_predict=opts.n_predict,
                          ignore_eos=opts.ignore_eos, ctx_shift=opts.context_shift, keep=opts.keep)
    chat = Chat(session, ui, plan, opts)
    if not opts.log_disable:
        if opts.verbose:
            for line in startup_lines(ctx, plan):
                ui.log(line)
            ui.err.print(breakdown_table(plan)) if not opts.simple_io else None
            ui.log(f"chat template: {template.describe}")
            ui.log(f"sampler seed: {sampler.seed}")
        else:
            chat.show_rows(startup_rows(ctx, plan, template, sampler, opts, load_ms), title="ubatch chat",
                           to_err=True)
        if template.name == "chatml" and len(ctx.model.vocab.tokenize("<|im_start|>", False, True)) != 1:
            ui.log("warning: the chatml template writes <|im_start|>, which is not a token of this "
                   "model's vocabulary: it is read as plain text")
        if opts.context_shift and not session.shift_in_answer:
            ui.log("note: --context-shift drops the oldest messages when the conversation outgrows the "
                   "context; shifting within an answer needs --swa-full for this model")
        ui.info(HINT)
    interactive = not opts.simple_io and sys.stdin.isatty() and sys.stdout.isatty()
    if not interactive and hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # undecodable bytes become U+FFFD, not a crash
    read = prompt_toolkit_reader() if interactive else plain_reader(echo=not sys.stdin.isatty())
    chat.run(read)
