"""Ctrl-C in the chat (issue 33): the answer stops, the conversation and its KV cache stay usable.

Once, Ctrl-C 147 tokens into an answer printed "(interrupted before the answer started)", /stats
showed an empty KV cache and the next turn prefilled everything again. The KeyboardInterrupt had
landed inside a decode step, after the token list grew and before the counts followed (during
the sampling), so the session found them disagreeing and emptied the cache; the message was
chosen from the emptied cache. Now the chat's Ctrl-C sets a flag that the engine polls between
prefill ubatches and decode steps (`stop`), and the message comes from what was generated.

* In-process: `stop` at every poll point of a turn (each prefill ubatch, each decode step), and
  an asynchronous KeyboardInterrupt inside the sampler; the cache, the token list and the counts
  agree afterwards and the next turn reuses the cache.
* The real chat in a pseudo-terminal: 16 Ctrl-C at varied delays, some during the prefill, most
  during the answer, each checked against the message, /stats and the next turn's reuse.
"""

from __future__ import annotations

import random
import re
import termios
import time
from pathlib import Path

import pytest

from ubatch.engine.chat.template import ChatTemplate
from ubatch.engine.completion.conversation import ChatSession
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams

LONG = "hello world the world " * 6  # ~25 tokens: a prefill of several ubatches at -ub 4


def session(m: Model, n_predict: int = 12) -> ChatSession:
    ctx = Context(m, ContextParams(n_ctx=512, n_ubatch=4, n_batch=512))
    params = GenerationParams(n_predict=n_predict, ignore_eos=True)
    return ChatSession(ctx, ChatTemplate.for_model(m), Sampler(SamplerParams(temp=0, seed=1)), params)


def in_cache(s: ChatSession) -> int:
    return s.ctx.memory.seq_pos_max(s.seq_id) + 1


def check_consistent(s: ChatSession) -> None:
    """The token list is what every cache holds, and the last turn's counts add up to it."""
    assert len(s.tokens) == in_cache(s) == s.ctx.memory.caches[0].used
    t = s.last
    if t is not None and t.n_prompt:
        pending = t.n_gen - t.n_eval  # the last sampled token waits for the next turn
        assert pending in (0, 1)
        assert len(s.tokens) == t.n_reused + t.n_prompt + t.n_eval


class StopAfter:
    """A `stop` that says yes at its n-th poll (and after)."""

    def __init__(self, n: int) -> None:
        self.n, self.polls = n, 0

    def __call__(self) -> bool:
        self.polls += 1
        return self.polls > self.n


def test_stop_at_every_poll_point_keeps_the_cache(tiny_gemma_model: Model) -> None:
    # how many polls a whole turn makes: before the prefill, after each ubatch but the last, before each step
    probe = session(tiny_gemma_model)
    "".join(probe.respond("hi"))
    count = StopAfter(10**9)
    "".join(probe.respond(LONG, stop=count))
    n_polls = count.polls
    assert n_polls > 12  # the prefill's ubatches and the answer's steps
    for n in range(n_polls):
        s = session(tiny_gemma_model)
        "".join(s.respond("hi"))
        before = (list(s.tokens), list(s.messages), s.turns)
        answer = "".join(s.respond(LONG, stop=StopAfter(n)))
        t = s.last
        assert t is not None and t.stop_reason == "interrupted"
        check_consistent(s)
        if t.n_gen == 0:  # stopped in the prefill: the turn is forgotten, the cache as it was
            assert t.n_prompt == 0 and answer == ""
            assert (s.tokens, s.messages, s.turns) == before
        else:
            assert t.n_prompt == t.n_turn and t.n_reused == len(before[0])
            assert s.messages[-1] == {"role": "assistant", "content": answer} and s.turns == 2
        n_cached = len(s.tokens)
        "".join(s.respond("the end"))  # the next turn reuses everything the cache held
        t2 = s.last
        assert t2 is not None and t2.stop_reason == "length"
        assert t2.n_reused == n_cached and t2.reprocess == "" and t2.n_prompt == t2.n_turn
        check_consistent(s)


def test_keyboard_interrupt_inside_the_sampler_keeps_the_cache(tiny_gemma_model: Model) -> None:
    """The race as it was: an asynchronous KeyboardInterrupt while a step samples, after the token
    list grew. The counts now follow the list before sampling, so the cache is kept."""
    for k in (2, 5, 9):
        s = session(tiny_gemma_model, n_predict=30)
        "".join(s.respond("hi"))
        sample, calls = s.sampler.sample, [0]

        def interrupting(x, sample=sample, calls=calls, k=k):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == k:
                raise KeyboardInterrupt
            return sample(x)

        s.sampler.sample = interrupting  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            "".join(s.respond(LONG))
        s.sampler.sample = sample  # type: ignore[method-assign]
        t = s.last
        assert t is not None and t.stop_reason == "interrupted" and t.n_gen == k - 1
        assert len(s.tokens) > 0  # not emptied
        check_consistent(s)
        n_cached = len(s.tokens)
        "".join(s.respond("the end"))
        assert s.last is not None and s.last.n_reused == n_cached and s.last.reprocess == ""


# -- the real chat in a pseudo-terminal -----------------------------------------------------------

N_RUNS = 16
STATS = (
    r"(?s)turns: (\d+) · messages: (\d+) · (\d+) / \d+ tokens in the KV cache.*?"
    r"prompt tokens evaluated last turn: (\d+) · reused from the KV cache: (\d+) · "
    r"new turn tokens: (\d+) · generated: (\d+) · stop: (\w+).*?non-SWA: (\d+) / \d+ cells used"
)
OUTCOME = r"\((answer interrupted|interrupted before the answer started)\)|context full"


def wait_for_cooked_mode(fd: int, timeout: float = 60) -> None:
    """Until the terminal turns Ctrl-C into SIGINT again: the line editor reads keys in raw mode,
    where a Ctrl-C typed right after Enter is a byte of input, not a signal."""
    end = time.time() + timeout
    while not termios.tcgetattr(fd)[3] & termios.ISIG:
        assert time.time() < end, "the line editor did not hand the message over"
        time.sleep(0.002)


def test_ctrl_c_at_random_points_of_the_prefill_and_the_answer(tiny_gemma: Path, tmp_path: Path) -> None:
    from test_chat import PROMPT, Term

    # no -n and --ignore-eos: every answer runs until Ctrl-C, so each interrupt lands in the turn.
    # Even runs: Ctrl-C soon after Enter (in the prefill, or early in the answer on a fast
    # machine); odd runs: once the answer streams.
    args = ["-m", str(tiny_gemma), "-c", "8192", "-ub", "1", "--temp", "0", "--ignore-eos", "--log-disable"]
    t = Term([*args, "--no-show-timings"], tmp_path)
    try:
        t.expect(PROMPT)
        rng = random.Random(33)
        used, turns, seen = 0, 0, {"answer interrupted": 0, "interrupted before the answer started": 0}
        for i in range(N_RUNS):
            # random letters: a token each, so the prefill is 100-180 ubatches at -ub 1
            message = f"{i} " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(100, 180)))
            t.say(message)
            wait_for_cooked_mode(t.child.child_fd)  # the line editor has handed the message over
            in_answer = i % 2 == 1
            if in_answer:
                t.expect(re.escape(message[-20:]) + r"\n(?s:.{20})")  # the answer streams
            time.sleep(rng.uniform(0.0, 0.2 if in_answer else 0.15))
            t.child.sendintr()
            m = t.expect(OUTCOME, timeout=60)
            t.expect(PROMPT)
            t.say("/stats")
            st = t.expect(STATS, timeout=30)
            t.expect(PROMPT)
            n_turns, _, n_used, evaluated, reused, n_turn, generated = (int(x) for x in st.groups()[:7])
            stop, cells = st.group(8), int(st.group(9))
            info = f"run {i}: {m.group(0)}; {st.group(0)}"
            assert n_used == cells, info  # the token list is what the cache holds
            if m.group(0) == "context full":  # not at these delays; start over and go on
                t.say("/clear")
                t.expect(PROMPT)
                used, turns = 0, 0
                continue
            seen[m.group(1)] += 1
            assert stop == "interrupted", info
            if m.group(1) == "answer interrupted":
                assert generated > 0 and n_turns == turns + 1, info
                assert reused == used and evaluated == n_turn, info  # the cache was reused, no re-prefill
                assert n_used - (reused + evaluated + generated) in (0, -1), info  # all kept but the last token
            else:
                assert not in_answer, info
                assert generated == 0 and evaluated == 0 and n_turns == turns, info  # the turn is forgotten
                assert n_used == used, info  # and the cache is as it was
            used, turns = n_used, n_turns
            if used > 4096:
                t.say("/clear")
                t.expect(PROMPT)
                used, turns = 0, 0
        print(f"{N_RUNS} interrupts: {seen}")
        assert seen["answer interrupted"] >= N_RUNS // 2
        t.child.sendeof()
        t.expect(r"Exiting\.\.\.")
        assert t.finish() == 0
    finally:
        if not t.child.closed:
            t.child.close(force=True)
