"""`ubatch cli` without -p (or with -cnv): a conversation in the terminal.

The loop: read a message (cli/complete/chat_input.py), hand it to the engine's ChatSession
(engine/completion/conversation.py: chat template, KV cache reuse between turns), stream the
answer and the per-turn speeds (cli/complete/chat_view.py), and run the slash commands. What is
read, what is computed and what is shown each live in their own module.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.text import Text

from ubatch.cli.complete.chat_input import LineEditor, Reader, make_reader
from ubatch.cli.complete.chat_view import COMMANDS, HINT, ChatUI, PrefillProgress, startup_rows, stats_rows
from ubatch.engine.chat.template import ChatTemplate, ChatTemplateError
from ubatch.engine.completion.conversation import ChatInputError, ChatSession, looks_like_base_model
from ubatch.engine.context.context import Context
from ubatch.engine.context.report import MemoryPlan
from ubatch.engine.errors import UbatchError
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.sampling.chain import Sampler
from ubatch.engine.spec.speculative import Speculator

__all__ = ["BASE_MODEL_NOTE", "Chat", "ChatOptions", "PrefillProgress", "run_chat"]

BASE_MODEL_NOTE = (
    "this looks like a base model (no chat template in the GGUF, no it/instruct/chat in its name): "
    "answers may ramble and not end their turn; use -m with an instruction-tuned GGUF, or -p for plain completion"
)


class CtrlC:
    """Ctrl-C in the chat: at the prompt, KeyboardInterrupt (the reader says how to leave);
    anywhere else, a flag the engine polls between prefill ubatches and decode steps.

    The default handler raised KeyboardInterrupt wherever the main thread was: in the middle of
    the session's bookkeeping (the token list grown, the counts not yet) it left a conversation
    whose cache could not be trusted, so it was emptied and the next turn prefilled everything.
    A flag is read only where the cells and the token list agree. It is cleared when a message
    is read, so a Ctrl-C between Enter and the start of the turn still stops that turn. With the
    line editor (LineEditor) a SIGINT while reading only sets the flag: the editor takes Ctrl-C as
    a key in raw mode, so a SIGINT comes in the cooked moments around it, mostly just after Enter,
    where raising would drop the message that was just sent. With plain input() it raises."""

    def __init__(self) -> None:
        self.pressed = False
        self.reading = False
        self.raise_when_reading = True

    def __call__(self) -> bool:
        return self.pressed

    def _handler(self, signum: int, frame: object) -> None:
        self.pressed = True
        if self.reading and self.raise_when_reading:
            raise KeyboardInterrupt

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The handler for the chat's life (main thread only: elsewhere signals cannot be
        handled, and KeyboardInterrupt keeps its old path)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = signal.signal(signal.SIGINT, self._handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, old)

    def read(self, read: Reader) -> str:
        """The next message; Ctrl-C while waiting for it raises KeyboardInterrupt."""
        self.pressed, self.reading = False, True
        self.raise_when_reading = not isinstance(read, LineEditor)
        try:
            return read()
        finally:
            self.reading = False


@dataclass(slots=True)
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
    generation: GenerationParams = field(default_factory=GenerationParams)  # every answer's (-n, -r, -l, ...)
    color: str = "auto"  # -co: on, off, auto
    speculator: Speculator | None = None  # -md, --spec-type


class Chat:
    """One conversation: turns, slash commands and the read loop."""

    def __init__(self, session: ChatSession, ui: ChatUI, plan: MemoryPlan, opts: ChatOptions) -> None:
        self.session, self.ui, self.plan, self.opts = session, ui, plan, opts
        self.can_progress = not opts.simple_io and not opts.log_disable and ui.err.is_terminal
        self.ctrl_c = CtrlC()

    def turn(self, text: str, regen: bool = False) -> bool:
        """One answer; False if the turn failed with an error (the chat goes on, -st exits 1)."""
        s, ui = self.session, self.ui
        prog = PrefillProgress(ui.err, self.can_progress)
        try:
            it = s.regenerate(prog, self.ctrl_c) if regen else s.respond(text, prog, self.ctrl_c)
        except (ChatInputError, ChatTemplateError) as e:
            ui.error(str(e))
            return False
        interrupted = False
        try:
            for piece in it:
                prog.stop()
                ui.piece(piece)
        except KeyboardInterrupt:  # raised by other means than the terminal's Ctrl-C
            interrupted = True
            close = getattr(it, "close", None)
            if close is not None:
                close()  # the session keeps what was decoded
        except UbatchError as e:
            prog.stop()
            ui.end_answer()
            ui.error(str(e))
            return False
        finally:
            prog.stop()
        ui.end_answer()
        ts = s.last
        if ts is None:
            return True
        if self.opts.verbose:
            ui.log(f"chat: formatted turn {ts.turn}: {json.dumps(ts.turn_text, ensure_ascii=False)}")
        if interrupted or ts.stop_reason == "interrupted":
            # said from what was generated, not from what the cache kept (it may have been emptied)
            ui.info("(answer interrupted)" if ts.n_gen else "(interrupted before the answer started)")
        elif ts.stop_reason == "context":
            hint = "restart with a larger -c or with --context-shift"
            if self.opts.generation.ctx_shift and not s.shift_in_answer:
                hint = "restart with a larger -c (shifting within an answer needs --swa-full for this model)"
            ui.info(
                f"context full ({s.n_ctx} tokens): the answer was cut; /clear to start over, or {hint}", style="yellow"
            )
        if ts.n_dropped:
            ui.info(
                f"(the conversation outgrew the context: dropped the {ts.n_dropped} oldest messages)", style="yellow"
            )
        if self.opts.verbose:
            ui.log(
                f"chat: turn {ts.turn}: {ts.n_prompt} prompt tokens evaluated, {ts.n_reused} reused from "
                f"the KV cache, {ts.n_gen} generated (stop: {ts.stop_reason}), context "
                f"{len(s.tokens)}/{s.n_ctx}" + (f"; reprocessed: {ts.reprocess}" if ts.reprocess else "")
            )
        if self.opts.show_timings and ts.n_prompt:
            ui.timings(ts)
        return True

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
            ui.rows(stats_rows(s, self.plan))
        elif cmd == "/help":
            ui.rows(COMMANDS)
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
            ui.error(
                f"unknown command {cmd}: type /help for the commands (start a message with // to send a leading /)"
            )
        return True

    def run(self, read: Reader) -> int:
        """The read loop; the exit status: 1 when a single turn (-st) failed with an error."""
        with self.ctrl_c.installed():
            return self._run(read)

    def _run(self, read: Reader) -> int:
        opts, ui = self.opts, self.ui
        if opts.first_prompt is not None:
            ui.out.print(Text("> ", style="bold") + Text(opts.first_prompt), soft_wrap=True)
            ok = self.turn(opts.first_prompt)
            if opts.single_turn:
                ui.info("Exiting...")
                return 0 if ok else 1
        status = 0
        while True:
            try:
                line = self.ctrl_c.read(read)
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
            ok = self.turn(line)
            if opts.single_turn and (self.session.turns > before or (not ok and line.strip())):
                status = 0 if ok else 1  # a blank line is asked again; a failed message ends -st
                break
        ui.info("Exiting...")
        return status


def run_chat(ctx: Context, sampler: Sampler, opts: ChatOptions, load_ms: float) -> int:
    """Start the conversation on a loaded, warmed-up context; the exit status (Chat.run)."""
    from ubatch.cli.memory_view import breakdown_table
    from ubatch.cli.present import startup_lines
    from ubatch.engine.context.report import memory_plan

    template = ChatTemplate.for_model(ctx.model, override=opts.chat_template, use_jinja=opts.use_jinja)
    ui = ChatUI(opts.simple_io, opts.color)
    plan = memory_plan(ctx)
    session = ChatSession(ctx, template, sampler, opts.generation, system=opts.system, speculator=opts.speculator)
    base = looks_like_base_model(ctx.model.gguf.metadata, ctx.model.path.name)
    if not opts.log_disable:
        if opts.verbose:
            for line in startup_lines(ctx, plan):
                ui.log(line)
            if not opts.simple_io:
                ui.err.print(breakdown_table(plan))
            ui.log(f"chat template: {template.describe}")
            ui.log(f"sampler seed: {sampler.seed}")
            if base:
                ui.log(f"note: {BASE_MODEL_NOTE}")
        else:
            rows = startup_rows(ctx, plan, template, sampler, load_ms, opts.system, opts.generation.n_predict)
            if base:
                rows.append(("note", BASE_MODEL_NOTE))
            ui.rows(rows, title="ubatch chat", to_err=True)
        if template.name == "chatml" and len(ctx.model.vocab.tokenize("<|im_start|>", False, True)) != 1:
            ui.log(
                "warning: the chatml template writes <|im_start|>, which is not a token of this model's vocabulary: it is read as plain text"
            )
        if opts.generation.ctx_shift and not session.shift_in_answer:
            ui.log(
                "note: --context-shift drops the oldest messages when the conversation outgrows the "
                "context; shifting within an answer needs --swa-full for this model"
            )
        ui.info(HINT)
    return Chat(session, ui, plan, opts).run(make_reader(opts.simple_io))
