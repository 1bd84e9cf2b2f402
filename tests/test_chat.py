"""`ubatch cli` conversations.

* ChatSession on the tiny model: KV cache reuse between turns (a turn prefills only itself),
  Ctrl-C during the prefill or the answer, a full context, sliding-window rollback, progress.
* The default model in-process: the second answer computed on the reused cache is the answer a
  fresh context gives for the whole conversation.
* The real chat driven through a pseudo-terminal (pexpect): two turns with KV reuse checked from
  /stats against token counts computed here from the reference's gemma format, /clear, bad input,
  Ctrl-C during an answer, a system prompt, single turn.
* The command line with piped input (no terminal), through the real CLI in this process.
"""

from __future__ import annotations

import io
import os
import re
import sys
import time
from pathlib import Path

import cli_inproc
import pytest

from ubatch.engine.chat.template import ChatTemplate
from ubatch.engine.completion.complete import complete
from ubatch.engine.completion.conversation import ChatInputError, ChatSession, ContextFullError
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams


def greedy() -> Sampler:
    return Sampler(SamplerParams(temp=0, seed=1))


def session(
    m: Model, n_ctx: int = 256, n_ubatch: int = 512, system: str | None = None, n_predict: int = 3, **kw: bool
) -> ChatSession:
    ctx = Context(m, ContextParams(n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=max(n_ctx, n_ubatch)))
    params = GenerationParams(n_predict=n_predict, **kw)
    return ChatSession(ctx, ChatTemplate.for_model(m), greedy(), params, system=system)


def in_cache(s: ChatSession) -> int:
    """Tokens the sequence holds in the KV cache (every cache agrees on the last position)."""
    return s.ctx.memory.seq_pos_max(s.seq_id) + 1


# -- ChatSession on the tiny model ----------------------------------------------------------------


def test_second_turn_prefills_only_itself(tiny_gemma_model: Model) -> None:
    s = session(tiny_gemma_model)
    v = s.vocab
    "".join(s.respond("hello"))
    t1 = s.last
    assert t1 is not None and t1.stop_reason == "length" and t1.n_gen == 3
    first = v.tokenize("<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n", True, True)
    assert t1.n_prompt == len(first) and t1.n_reused == 0
    # cut by -n: 3 tokens sampled, 2 decoded; the third waits for the next turn
    assert t1.n_past == len(first) + 2 == len(s.tokens) == in_cache(s)
    "".join(s.respond("the world"))
    t2 = s.last
    assert t2 is not None
    turn = v.tokenize("<end_of_turn>\n<start_of_turn>user\nthe world<end_of_turn>\n<start_of_turn>model\n", False, True)
    assert t2.turn_text == "<end_of_turn>\n<start_of_turn>user\nthe world<end_of_turn>\n<start_of_turn>model\n"
    assert t2.n_reused == t1.n_past  # everything the cache held
    assert t2.n_prompt == t2.n_turn == 1 + len(turn)  # the undecoded answer token + the new turn
    assert t2.reprocess == ""
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    assert len(s.tokens) == in_cache(s) == t2.n_past


def test_system_prompt_and_clear(tiny_gemma_model: Model) -> None:
    s = session(tiny_gemma_model, system="be brief")
    "".join(s.respond("hello"))
    assert s.last is not None
    assert s.last.prompt_text == "<start_of_turn>user\nbe brief\n\nhello<end_of_turn>\n<start_of_turn>model\n"
    s.clear()
    assert s.tokens == [] and in_cache(s) == 0 and s.messages == [{"role": "system", "content": "be brief"}]
    "".join(s.respond("hello"))
    assert s.last is not None and s.last.n_reused == 0 and s.last.turn == 1


def test_empty_message_and_bad_template_leave_the_conversation_as_it_was(tiny_gemma_model: Model) -> None:
    s = session(tiny_gemma_model)
    "".join(s.respond("hello"))
    before = (list(s.messages), list(s.tokens))
    with pytest.raises(ChatInputError, match="empty message"):
        s.respond("  \n")
    s.set_template(ChatTemplate.from_metadata({}, "gemma3", override="{{ raise_exception('nope') }}"))
    from ubatch.engine.chat.template import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="nope"):
        s.respond("again")
    assert (s.messages, s.tokens) == before


def test_ctrl_c_during_the_answer_keeps_what_was_decoded(tiny_gemma_model: Model) -> None:
    s = session(tiny_gemma_model, n_predict=50, ignore_eos=True)
    it = s.respond("hello")
    next(it), next(it), next(it)
    it.close()  # what the CLI does on KeyboardInterrupt
    t = s.last
    assert t is not None and t.stop_reason == "interrupted"
    assert len(s.tokens) == in_cache(s) == t.n_past
    assert s.messages[-1]["role"] == "assistant"
    s.params.n_predict = 2
    "".join(s.respond("the world"))  # the conversation goes on from the cache
    assert s.last is not None and s.last.n_reused == t.n_past and s.last.reprocess == ""


def test_ctrl_c_during_the_prefill_forgets_the_turn(tiny_gemma_model: Model) -> None:
    s = session(tiny_gemma_model, n_ubatch=4)
    "".join(s.respond("hello"))
    before = (list(s.messages), list(s.tokens))

    def interrupt(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        "".join(s.respond("the world hello the world", progress=interrupt))
    assert s.last is not None and s.last.stop_reason == "interrupted" and s.turns == 1
    assert (s.messages, s.tokens) == before and in_cache(s) == len(before[1])
    "".join(s.respond("the world"))
    assert s.last is not None and s.last.n_reused == len(before[1])


def test_prefill_progress_counts_ubatches(tiny_gemma_model: Model) -> None:
    s = session(tiny_gemma_model, n_ubatch=4)
    calls: list[tuple[int, int]] = []
    "".join(s.respond("hello world the world", progress=lambda d, t: calls.append((d, t))))
    n = s.last.n_prompt if s.last else 0
    total = -(-n // 4)
    assert calls == [(i, total) for i in range(1, total + 1)]


def test_full_context_refused_or_oldest_messages_dropped(tiny_gemma_model: Model) -> None:
    long = "hello world " * 40  # ~80 tokens a turn in a 256-token context
    s = session(tiny_gemma_model, n_predict=2)
    "".join(s.respond(long))
    "".join(s.respond(long))
    with pytest.raises(ContextFullError, match="--context-shift"):
        s.respond(long + "the end")
    assert len(s.messages) == 4
    s = session(tiny_gemma_model, n_predict=2, ctx_shift=True, system="be brief")
    for i in range(3):
        "".join(s.respond(f"{i} " + long))
    t = s.last
    assert t is not None and t.n_dropped >= 2 and "dropped" in t.reprocess
    assert s.messages[0] == {"role": "system", "content": "be brief"}
    assert s.messages[1]["role"] == "user" and len(s.tokens) < 256
    assert t.n_reused < t.n_prompt  # the shortened conversation was prefilled again


def test_too_long_names_the_rounding_of_c(tiny_gemma_model: Model) -> None:
    """llama.cpp pads n_ctx to a multiple of 256: after -c 64, "the context holds 256" alone
    reads like a bug, so the message names the rule that changed the value."""
    from ubatch.engine.completion.complete import check_prompt_fits
    from ubatch.engine.errors import ContextError

    with pytest.raises(
        ContextError, match=r"the context holds 256 \(-c 64 -> n_ctx 256, padded to a multiple of 256\)"
    ):
        check_prompt_fits(Context(tiny_gemma_model, ContextParams(n_ctx=64)), 300)
    with pytest.raises(ContextError, match=r"the context holds 256; raise -c"):  # as asked: nothing to name
        check_prompt_fits(Context(tiny_gemma_model, ContextParams(n_ctx=256)), 300)
    with pytest.raises(ContextError, match=r"holds 2048 \(-c 0 -> n_ctx 2048, the model's training context\)"):
        check_prompt_fits(Context(tiny_gemma_model, ContextParams(n_ctx=0)), 3000)
    with pytest.raises(ContextError, match=r"holds 256 \(-c 512 -np 2 -> n_ctx_seq 256 per sequence\)"):
        check_prompt_fits(Context(tiny_gemma_model, ContextParams(n_ctx=512, n_seq_max=2)), 300)
    ctx = Context(tiny_gemma_model, ContextParams(n_ctx=64))
    s = ChatSession(ctx, ChatTemplate.for_model(tiny_gemma_model), greedy(), GenerationParams(n_predict=2))
    with pytest.raises(ContextFullError, match=r"the context holds 256 \(-c 64 -> n_ctx 256"):
        s.respond("hello world " * 140)


def test_single_turn_exits_1_when_the_template_fails(
    tiny_gemma_model: Model, capsys: pytest.CaptureFixture[str]
) -> None:
    """-st with a message the chat template cannot render (issue 32): the error, then exit 1."""
    from ubatch.cli.complete.chat import Chat, ChatOptions
    from ubatch.cli.complete.chat_view import ChatUI
    from ubatch.engine.context.report import memory_plan

    ctx = Context(tiny_gemma_model, ContextParams(n_ctx=256))
    bad = ChatTemplate.from_metadata({}, "gemma3", override="{{ raise_exception('no such role') }}")
    for first, lines in (("hi", []), (None, ["", "hi"])):  # -p; typed (a blank line is asked again)
        s = ChatSession(ctx, bad, greedy(), GenerationParams(n_predict=2))
        opts = ChatOptions(first_prompt=first, single_turn=True, simple_io=True)
        chat = Chat(s, ChatUI(simple_io=True), memory_plan(ctx), opts)
        feed = iter(lines)

        def read(feed=feed) -> str:  # type: ignore[no-untyped-def]
            try:
                return next(feed)
            except StopIteration:
                raise EOFError from None

        assert chat.run(read) == 1
        err = capsys.readouterr().err
        assert "no such role" in err and ("empty message" in err) == (first is None)
    s = ChatSession(ctx, ChatTemplate.for_model(tiny_gemma_model), greedy(), GenerationParams(n_predict=2))
    assert (
        Chat(s, ChatUI(simple_io=True), memory_plan(ctx), ChatOptions(first_prompt="hi", single_turn=True)).run(
            lambda: ""
        )
        == 0
    )


def test_context_shift_within_an_answer_keeps_the_token_list_in_step(tiny_gemma_model: Model) -> None:
    m = tiny_gemma_model
    ctx = Context(m, ContextParams(n_ctx=256, swa_full=True))  # every cache full-size: K-shift allowed
    # a first prompt of 196 tokens, all kept (--keep -1): the context is full after 59 answer
    # tokens; the shift drops half of those, and 64 tokens end before a second shift
    s = ChatSession(
        ctx,
        ChatTemplate.for_model(m),
        greedy(),
        GenerationParams(n_predict=64, ignore_eos=True, ctx_shift=True, n_keep=-1),
        system="be brief",
    )
    assert s.shift_in_answer
    "".join(s.respond("hello world " * 85))
    t = s.last
    assert t is not None and t.n_shifts == 1 and t.stop_reason == "length" and t.n_gen == 64
    assert len(s.tokens) == in_cache(s) == t.n_past < 256
    first = m.vocab.tokenize(t.prompt_text, True, True)
    assert s.tokens[: len(first)] == first  # --keep -1: the first prompt survives the shifts
    s.params.n_predict = 2
    "".join(s.respond("the world"))
    assert s.last is not None and s.last.n_reused == t.n_past and s.last.reprocess == ""


def test_sliding_window_cache_that_lost_the_prefix_is_prefilled_again(tiny_gemma_model: Model) -> None:
    # n_swa 8 and -ub 8: the SWA cache has 256 cells for a 512 context; after 280 tokens the
    # cells of the first positions were reused, so a conversation diverging at token 1 cannot
    # keep the cache's prefix
    s = session(tiny_gemma_model, n_ctx=512, n_ubatch=8, n_predict=2)
    "".join(s.respond("hello world " * 140))
    assert s.ctx.memory.seq_pos_min(0) > 0
    short = "{% for m in messages %}{{ m.content[:5] }}{% endfor %}"  # diverges at token 1
    s.set_template(ChatTemplate.from_metadata({}, "gemma3", override=short))
    "".join(s.respond("hello"))
    t = s.last
    assert t is not None and t.n_reused == 0 and "sliding-window" in t.reprocess
    assert len(s.tokens) == in_cache(s)


def test_regenerate(tiny_gemma_model: Model) -> None:
    s = session(tiny_gemma_model)
    a = "".join(s.respond("hello"))
    n_prompt = s.last.n_prompt if s.last else 0
    b = "".join(s.regenerate())
    assert a == b and s.turns == 1 and len(s.messages) == 2
    assert s.last is not None and s.last.n_reused == n_prompt - 1  # the prompt, up to its last token


# -- the default model: the reused cache gives the answer a fresh context gives --------------------


@pytest.mark.slow
def test_second_answer_on_reused_cache_equals_fresh_context(default_model: Model) -> None:
    m = default_model
    ctx = Context(m, ContextParams(n_ctx=256))
    ctx.warmup()  # the dense f32 weights, as the CLI makes them
    s = ChatSession(ctx, ChatTemplate.for_model(m), greedy(), GenerationParams(n_predict=8))
    "".join(s.respond("What is the capital of France?"))
    assert s._stream is not None
    conversation = list(s._stream)  # what the model saw and wrote, the undecoded token included
    second = "".join(s.respond("And of Germany?"))
    assert s.last is not None and s.last.n_reused > 0
    conversation += m.vocab.tokenize(s.last.turn_text, add_special=False, parse_special=True)
    fresh = Context(m, ContextParams(n_ctx=256))
    text = "".join(ev.text for ev in complete(fresh, conversation, greedy(), GenerationParams(n_predict=8)))
    assert text == second


# -- the real chat through a pseudo-terminal ------------------------------------------------------

pexpect = pytest.importorskip("pexpect")
ANSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\x1b[()][A-Z0-9]|\x1b[=>]|\x08|\r")
TIMINGS = r"\[ Prompt: \d+\.\d t/s \| Generation: \d+\.\d t/s \]"
PROMPT = r"(?m)^>  ?"  # prompt_toolkit draws "> " as ">" and a cursor move


def clean(raw: str) -> str:
    """Terminal output as text: escape sequences removed, cursor-forward moves as spaces."""
    return ANSI.sub(lambda m: " " * int(m.group(1) or 1) if m.group(2) == "C" else "", raw)


class Term:
    """A chat in a pty, read as cleaned text; expect() moves past each match."""

    def __init__(self, args: list[str], tmp: Path) -> None:
        env = dict(
            os.environ, NO_COLOR="1", PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm", XDG_STATE_HOME=str(tmp), COLUMNS="250"
        )
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "ubatch.cli.main", "cli", *args],
            env=env,
            encoding="utf-8",
            dimensions=(60, 250),
            timeout=30,
        )
        self.raw, self.pos = "", 0

    def expect(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        rx, end = re.compile(pattern), time.time() + timeout
        while True:
            text = clean(self.raw)
            m = rx.search(text, self.pos)
            if m:
                self.pos = m.end()
                return m
            if not self.child.isalive() and not self.child.closed:
                try:
                    self.raw += self.child.read_nonblocking(1 << 16, timeout=0.1)
                    continue
                except (pexpect.EOF, pexpect.TIMEOUT):
                    raise AssertionError(f"exited waiting for {pattern!r}:\n{text[-3000:]}") from None
            if time.time() > end:
                raise AssertionError(f"timeout waiting for {pattern!r}:\n{text[-3000:]}")
            try:
                self.raw += self.child.read_nonblocking(1 << 16, timeout=0.2)
            except pexpect.TIMEOUT:
                pass
            except pexpect.EOF:
                if not rx.search(clean(self.raw), self.pos):
                    raise AssertionError(f"EOF waiting for {pattern!r}:\n{clean(self.raw)[-3000:]}") from None

    def say(self, line: str) -> None:
        self.child.sendline(line)

    def stats(self) -> dict[str, str]:
        self.say("/stats")
        m = self.expect(
            r"prompt tokens evaluated last turn: (\d+) · reused from the KV cache: (\d+) · "
            r"new turn tokens: (\d+) · generated: (\d+) · stop: (\w+)"
        )
        self.expect(PROMPT)
        return dict(zip(("evaluated", "reused", "turn", "generated", "stop"), m.groups()))

    def finish(self) -> int:
        self.child.expect(pexpect.EOF, timeout=60)
        self.child.close()
        return self.child.exitstatus


@pytest.fixture
def term(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Start chats in a pty; any still running at the end of the test is ended."""
    started: list[Term] = []

    def start(*args: str) -> Term:
        started.append(Term(list(args), tmp_path))
        return started[-1]

    yield start
    for t in started:
        if not t.child.closed:
            t.child.close(force=True)


@pytest.fixture(scope="module")
def gemma_vocab(default_model_path: Path):  # type: ignore[no-untyped-def]
    from ubatch.engine.gguf.file import open_gguf
    from ubatch.engine.vocab.vocab import Vocab

    return Vocab.from_metadata(open_gguf(default_model_path).metadata, "gemma")


Q1, Q2 = "What is the capital of France?", "And what about Germany?"


@pytest.mark.slow
def test_chat_two_turns_reuse_the_kv_cache_then_clear(
    default_model_path: Path,
    gemma_vocab,
    term,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    t = term("-cnv", "--temp", "0", "--seed", "1", "-n", "24", "-c", "2048")
    t.expect(r"ubatch chat")  # the startup panel
    t.expect(r"KV cache +non-SWA 2048 cells")
    t.expect(r"template +gemma \(built-in")
    t.expect(PROMPT)
    t.say(Q1)
    answer1 = t.expect(re.escape(Q1) + r"\n((?s:.*?))\n" + TIMINGS, timeout=180).group(1)
    t.expect(PROMPT)
    s1 = t.stats()
    # turn 1: the whole prompt, formatted as the reference's gemma format, BOS added
    first = gemma_vocab.tokenize(f"<start_of_turn>user\n{Q1}<end_of_turn>\n<start_of_turn>model\n", True, True)
    assert int(s1["evaluated"]) == len(first) and s1["reused"] == "0"
    cut = 1 if s1["stop"] == "length" else 0  # an answer cut by -n leaves its last token undecoded
    t.say(Q2)
    t.expect(re.escape(Q2) + r"\n(?s:.*?)" + TIMINGS, timeout=180)
    t.expect(PROMPT)
    s2 = t.stats()
    # turn 2 evaluates only the new turn: the end of the first answer, the user turn, the model header
    turn2 = gemma_vocab.tokenize(
        f"<end_of_turn>\n<start_of_turn>user\n{Q2}<end_of_turn>\n<start_of_turn>model\n", False, True
    )
    assert int(s2["evaluated"]) == int(s2["turn"]) == len(turn2) + cut
    assert int(s2["reused"]) == len(first) + int(s1["generated"]) - cut
    # bad input: one line each, and the conversation goes on
    t.say("/frobnicate")
    t.expect(r"error: unknown command /frobnicate")
    t.say("")
    t.expect(r"error: empty message")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }")
    t.say(f"/template {tmp_path / 'bad.jinja'}")
    t.expect(r"error: .*bad\.jinja: invalid Jinja chat template.*the chat template stays gemma")
    t.expect(PROMPT)
    assert t.stats() == s2  # nothing happened to the conversation
    t.say("/clear")
    t.expect(r"conversation cleared")
    t.expect(PROMPT)
    t.say("/stats")
    t.expect(r"turns: 0 · messages: 0 · 0 / 2048 tokens in the KV cache")
    t.expect(PROMPT)
    t.say(Q1)  # after /clear the same question gets the same greedy answer from an empty cache
    again = t.expect(re.escape(Q1) + r"\n((?s:.*?))\n" + TIMINGS, timeout=180).group(1)
    assert again == answer1
    t.expect(PROMPT)
    s3 = t.stats()
    assert s3 == s1
    t.child.sendeof()
    t.expect(r"Exiting\.\.\.")
    assert t.finish() == 0


@pytest.mark.slow
def test_chat_ctrl_c_stops_the_answer_not_the_chat(default_model_path: Path, term) -> None:  # type: ignore[no-untyped-def]
    t = term("-cnv", "--temp", "0", "--seed", "1", "-n", "400", "--ignore-eos", "-c", "2048")
    t.expect(PROMPT)
    t.say("Tell me a long story.")
    t.expect(r"long story\.\n\S+ \S+", timeout=180)  # the answer is streaming
    t0 = time.time()
    t.child.sendintr()
    t.expect(r"\(answer interrupted\)\n" + TIMINGS, timeout=60)
    t.expect(PROMPT)
    assert time.time() - t0 < 30  # well before 400 tokens
    s = t.stats()
    assert s["stop"] == "interrupted" and 0 < int(s["generated"]) < 400
    t.child.sendintr()  # Ctrl-C at the prompt does not leave either
    t.expect(r"Ctrl-D or /exit leaves")
    t.say("/exit")
    t.expect(r"Exiting\.\.\.")
    assert t.finish() == 0


def test_chat_system_prompt_single_turn(tiny_gemma: Path, term) -> None:  # type: ignore[no-untyped-def]
    t = term(
        "-m",
        str(tiny_gemma),
        "-sys",
        "You are a pirate.",
        "-p",
        "Hello",
        "-st",
        "--temp",
        "0",
        "-n",
        "8",
        "-c",
        "512",
        "--verbose",
    )
    t.expect(r"llama_context: n_ctx += 512")  # --verbose: llama.cpp's startup lines
    t.expect(r"chat template: gemma")
    t.expect(r"> Hello\n")
    # the system prompt is merged into the first user turn (gemma has no system turn)
    t.expect(
        r'chat: formatted turn 1: "<start_of_turn>user\\nYou are a pirate\.\\n\\nHello<end_of_turn>'
        r'\\n<start_of_turn>model\\n"'
    )
    t.expect(r"chat: turn 1: \d+ prompt tokens evaluated, 0 reused")
    t.expect(TIMINGS)
    t.expect(r"Exiting\.\.\.")
    assert t.finish() == 0


def test_line_editing_multiline_and_history(tiny_gemma: Path, term) -> None:  # type: ignore[no-untyped-def]
    t = term("-m", str(tiny_gemma), "-c", "256", "--temp", "0", "-n", "2", "--verbose")
    t.expect(PROMPT)
    t.child.send("hello \\\r")  # a trailing backslash continues the message on a new line
    time.sleep(0.3)
    t.child.send("world\r")
    t.expect(r'chat: formatted turn 1: "<start_of_turn>user\\nhello \\nworld<end_of_turn>')
    t.expect(PROMPT)
    t.child.send("the\x1b\r")  # Alt-Enter (Esc Enter) inserts a newline
    time.sleep(0.3)
    t.child.send("end\r")
    t.expect(r'chat: formatted turn 2: "<end_of_turn>\\n<start_of_turn>user\\nthe\\nend<end_of_turn>')
    t.expect(PROMPT)
    t.child.send("\x1b[A")  # Up: the previous message from the history
    time.sleep(0.3)
    t.child.send("\r")
    t.expect(r'chat: formatted turn 3: "<end_of_turn>\\n<start_of_turn>user\\nthe\\nend<end_of_turn>')
    t.expect(PROMPT)
    t.child.sendeof()
    t.expect(r"Exiting\.\.\.")
    assert t.finish() == 0


# -- the command line without a terminal (tiny model) ---------------------------------------------


def run_cli(*args: object, stdin: str = "") -> cli_inproc.Ran:
    """`ubatch cli ARGS` with piped input, through the real CLI in this process (tests/cli_inproc.py):
    a fresh process would spend seconds importing torch for the tiny model's milliseconds."""
    return cli_inproc.run_cli(["cli", *map(str, args)], {"COLUMNS": "200"}, stdin)


@pytest.fixture(scope="module")
def piped(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, cli_inproc.Ran]:
    """The runs below, once for the module."""
    bad = tmp_path_factory.mktemp("chat") / "t.jinja"
    bad.write_text("{% if %}")
    m = ["-m", tiny_gemma, "-c", 256, "--temp", 0]
    runs = {
        "conversation": ([*m, "-n", 3, "--log-disable"], "hello\n/stats\n/nope\n\nthe world\n/stats\n"),
        "single_turn": ([*m, "-n", 2, "-st", "--log-disable"], "hi\nmore\n"),
        "one_shot": ([*m, "-n", 2, "-p", "hello", "--log-disable"], ""),
        "bad_template": (["-m", tiny_gemma, "--chat-template", bad], "hi\n"),
        "st_render_error": (
            [*m, "-cnv", "-st", "--log-disable", "--chat-template", "{{ raise_exception('cannot render') }}"],
            "hi\n",
        ),
        "help": (["--help"], ""),
    }
    return {k: run_cli(*args, stdin=stdin) for k, (args, stdin) in runs.items()}


def test_piped_conversation(piped) -> None:  # type: ignore[no-untyped-def]
    r = piped["conversation"]
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout
    assert out.count("[ Prompt: ") == 2 and out.rstrip().endswith("Exiting...")
    assert "> hello\n" in out and "> the world\n" in out  # piped input is echoed
    evaluated = [int(x) for x in re.findall(r"prompt tokens evaluated last turn: (\d+)", out)]
    assert len(evaluated) == 2 and evaluated[1] < evaluated[0] + 8
    assert r.stderr.count("error: ") == 2
    assert "error: unknown command /nope" in r.stderr and "error: empty message" in r.stderr


def test_single_turn_and_one_shot(piped) -> None:  # type: ignore[no-untyped-def]
    r = piped["single_turn"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("[ Prompt: ") == 1 and "more" not in r.stdout
    r = piped["one_shot"]
    assert r.returncode == 0 and r.stdout.startswith("hello") and "[ Prompt" not in r.stdout  # one-shot


def test_single_turn_exits_1_after_a_template_error(piped) -> None:  # type: ignore[no-untyped-def]
    r = piped["st_render_error"]  # issue 32: it exited 0
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "error: " in r.stderr and "cannot render" in r.stderr


def test_bad_chat_template_at_startup_is_one_line(piped) -> None:  # type: ignore[no-untyped-def]
    r = piped["bad_template"]
    assert r.returncode == 1 and r.stdout == ""
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith("error: ") and "t.jinja" in line and "invalid Jinja" in line


def test_help_groups_the_flags(piped) -> None:  # type: ignore[no-untyped-def]
    r = piped["help"]
    assert r.returncode == 0
    for panel in ("Model", "Context", "Batching", "Sampling", "Output", "Conversation"):
        assert panel in r.stdout
    for opt in ("-cnv", "-sys", "--single-turn", "--chat-template", "--simple-io", "--verbose"):
        assert opt in r.stdout


def test_prefill_progress_bar_shows_ubatches() -> None:
    from rich.console import Console

    from ubatch.cli.complete.chat import PrefillProgress

    buf = io.StringIO()
    p = PrefillProgress(Console(file=buf, force_terminal=True, width=100), True, after_s=0.0)
    p(1, 4)
    p(2, 4)
    p.stop()
    assert "ubatches" in buf.getvalue() and "2/4" in clean(buf.getvalue())
    quiet = PrefillProgress(Console(file=io.StringIO(), force_terminal=True), True, after_s=60.0)
    quiet(1, 4)  # under a second: no bar
    assert quiet.bar is None
