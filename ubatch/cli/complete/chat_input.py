"""How the chat reads a message: a prompt_toolkit line editor on a terminal, plain lines otherwise.

Each reader is a `() -> str` that raises EOFError at the end of input, so the loop in cli.complete.chat
never knows which one it has.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Reader = Callable[[], str]


def history_path() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ubatch" / "chat_history"


def prompt_toolkit_reader() -> Reader:
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
        history=history,
        key_bindings=kb,
        multiline=True,
        prompt_continuation=lambda width, line, wrap: "." * (width - 1) + " ",
    )
    return LineEditor(session)


class LineEditor:
    """prompt_toolkit's prompt as a Reader. It runs without prompt_toolkit's own SIGINT handler:
    in raw mode Ctrl-C is a key (the editor raises KeyboardInterrupt itself), and a SIGINT can only
    come in the cooked moments around it, just after Enter above all. There prompt_toolkit's
    handler, still installed while the finished prompt tears down, swallowed it and the turn that
    followed ran on; the chat's own handler (chat.CtrlC) now sees it and stops that turn."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def __call__(self) -> str:
        return str(self.session.prompt("> ", handle_sigint=False))


def plain_reader(echo: bool) -> Reader:
    """input() with "> ": a trailing backslash continues on the next line. When stdin is not a
    terminal the lines read are echoed, so the transcript shows them."""

    def read() -> str:
        parts: list[str] = []
        marker = "> "
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


def make_reader(simple_io: bool) -> Reader:
    """The line editor when both ends are a terminal (and not --simple-io), plain lines otherwise."""
    interactive = not simple_io and sys.stdin.isatty() and sys.stdout.isatty()
    if not interactive and hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # undecodable bytes become U+FFFD, not a crash
    return prompt_toolkit_reader() if interactive else plain_reader(echo=not sys.stdin.isatty())
