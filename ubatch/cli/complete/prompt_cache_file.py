"""llama-completion's `--prompt-cache FILE`: restore the saved state of sequence 0 and keep the
part of it the new prompt starts with, then save the state after the prompt (or, with
`--prompt-cache-all`, after the generated text too) unless `--prompt-cache-ro`.

The state itself is engine/context/state.py's; this module is the command line's use of it and
its log lines (on stderr, as llama-completion's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ubatch.cli.common import err_console

if TYPE_CHECKING:
    from ubatch.engine.context.context import Context


@dataclass
class PromptCache:
    path: Path
    read_only: bool = False
    save_all: bool = False
    quiet: bool = False
    saved_tokens: list[int] = field(default_factory=list)  # what the file held, [] if none
    restore_ms: float = 0.0
    done: bool = False  # the state after the prompt was saved (or needed no saving)

    def log(self, line: str) -> None:
        if not self.quiet:
            err_console.print(line, markup=False, highlight=False, soft_wrap=True)

    def restore(self, ctx: Context, ids: list[int]) -> int:
        """Load the file (if any) into sequence 0; returns how many prompt tokens it covers."""
        from ubatch.engine.batch import common_prefix
        from ubatch.engine.context.state import restore, usable_prefix
        from ubatch.engine.context.state_file import StateError, read_file

        self.log(f"attempting to load saved session from '{self.path}'")
        if not self.path.exists() or (self.path.is_file() and self.path.stat().st_size == 0):
            self.log("session file does not exist, will create.")
            return 0
        t0 = time.perf_counter()
        try:
            st, _ = read_file(self.path)
            restore(ctx, st, 0)
        except StateError as e:
            raise StateError(f"--prompt-cache {self.path}: {e}") from None
        self.saved_tokens = st.tokens
        n_match = common_prefix(st.tokens, ids)
        n_keep = usable_prefix(ctx, 0, min(n_match, len(ids) - 1))  # at least one token evaluated
        ctx.memory.seq_rm(0, n_keep, -1)
        self.restore_ms = (time.perf_counter() - t0) * 1e3
        self.log(f"loaded a session with prompt size of {len(st.tokens)} tokens")
        if n_match == len(ids):
            self.log("session file has exact match for prompt!")
        elif n_match < len(ids) // 2:
            self.log(
                f"warning: session file has low similarity to prompt ({n_match} / {len(ids)} tokens); will mostly be reevaluated"
            )
        else:
            self.log(f"session file matches {n_match} / {len(ids)} tokens of prompt")
        self.log(f"prompt cache: restored {n_keep} tokens in {self.restore_ms:.2f} ms")
        return n_keep

    def after_prompt(self, ctx: Context, cache: list[int]) -> None:
        """Save after the prompt, as llama-completion does before its first sampled token."""
        if self.done:
            return
        self.done = True
        if not (self.read_only or self.save_all or cache == self.saved_tokens):
            self._save(ctx, cache)

    def at_end(self, ctx: Context, cache: list[int]) -> None:
        if self.save_all and not self.read_only:
            self._save(ctx, cache)

    def _save(self, ctx: Context, cache: list[int]) -> None:
        from ubatch.engine.context.state import capture
        from ubatch.engine.context.state_file import write_file

        t0 = time.perf_counter()
        n = write_file(self.path, capture(ctx, 0, list(cache)))
        self.log(
            f"prompt cache: saved {len(cache)} tokens ({n} bytes) to '{self.path}' in {(time.perf_counter() - t0) * 1e3:.2f} ms"
        )
