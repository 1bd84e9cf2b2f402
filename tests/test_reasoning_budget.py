"""The reasoning budget stage (engine/sampling/reasoning_budget.py) on its own and inside a
`Generation`: the start tag arms it (from the generation prompt or from generated text), each
token inside the block spends the budget, a spent budget forces the message and the end tag one
token per step, a natural end stops it, a new start re-arms it, a character split across tokens
is finished first; the forced tokens pass the chain, the speculative distribution and a lazy tool
grammar like any sampled token (the grammar engages on a call after the forced end)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_vocab import BYTE0, EOS, NEWLINE, piece_id

from ubatch.engine.chat.tools import Tool, ToolChoice, ToolFormat, build_tool_grammar, parse_chat_output
from ubatch.engine.generation.generation import Generation, GenerationParams
from ubatch.engine.model.model import Model
from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.sampling.reasoning_budget import BudgetState, ReasoningBudget, TokenMatcher, utf8_complete
from ubatch.engine.vocab.vocab import Vocab

START, END, FORCED = (1, 2), ((3, 4),), (9, 3, 4)


def test_matcher_finds_the_longest_sequence_and_starts_afresh() -> None:
    m = TokenMatcher([(5, 6), (6,), (), (5, 6)])  # repeats and empty sequences are dropped
    assert m.seqs == [(5, 6), (6,)]
    assert [m.advance(t) for t in (5, 6, 6, 5, 7, 6)] == [-1, 0, 1, -1, -1, 1]
    m.advance(5)
    m.reset()
    assert m.advance(6) == 1  # not (5, 6): the 5 was forgotten


def test_utf8_completeness_of_one_piece() -> None:
    assert utf8_complete(b"") and utf8_complete(b"a") and utf8_complete("é".encode())
    assert not utf8_complete(b"\xc3") and not utf8_complete("a€".encode()[:-1]) and not utf8_complete(b"\x80")
    assert utf8_complete("a€".encode()) and utf8_complete("😀".encode())


def budget(n: int, forced: tuple[int, ...] = FORCED) -> ReasoningBudget:
    return ReasoningBudget(n, START, END, forced)


def feed(b: ReasoningBudget, *tokens: int) -> None:
    for t in tokens:
        b.accept(t)


def test_spent_budget_forces_the_sequence_then_sampling_is_free() -> None:
    b = budget(3)
    feed(b, 7, 1)
    assert b.state is BudgetState.IDLE  # half a start tag
    feed(b, 2)
    assert b.state is BudgetState.COUNTING and b.remaining == 3
    feed(b, 7, 7)
    assert b.forcing is None and b.remaining == 1
    feed(b, 7)
    assert b.state is BudgetState.FORCING
    row = torch.linspace(0, 1, 12)
    for tok in FORCED:
        assert b.forcing == tok
        out = b.apply(row)
        assert out[tok] == row[tok] and torch.isinf(out).sum() == 11  # every other token -inf
        b.accept(tok)
    assert b.state is BudgetState.DONE and b.forcing is None and b.n_forced == 3
    assert torch.equal(b.apply(row), row)
    feed(b, 1, 2)  # a new block gets a fresh budget
    assert b.state is BudgetState.COUNTING and b.remaining == 3


def test_a_natural_end_stops_the_count() -> None:
    b = budget(10)
    feed(b, 1, 2, 7, 3, 4)
    assert b.state is BudgetState.DONE and b.n_forced == 0
    feed(b, 7, 7, 7)
    assert b.state is BudgetState.DONE


def test_zero_budget_forces_at_once_and_a_biased_out_forced_token_is_kept() -> None:
    b = budget(0)
    feed(b, 1, 2)
    assert b.forcing == 9
    row = torch.zeros(12)
    row[9] = float("-inf")  # a logit bias that banned it: forcing wins
    assert b.apply(row)[9] == 0.0
    # a generation prompt that goes on after its start tag does not move the forced sequence
    b = budget(0)
    feed(b, 1, 2, 6)
    assert b.forcing == 9


def test_nothing_to_force_leaves_the_block() -> None:
    b = budget(1, forced=())
    feed(b, 1, 2, 7)
    assert b.state is BudgetState.DONE and b.forcing is None


def test_the_end_waits_for_a_whole_character(tiny_gemma_model: Model) -> None:
    """A budget spent on the first byte of "€" (three byte tokens) runs on to the third."""
    vocab: Vocab = tiny_gemma_model.vocab
    euro = [BYTE0 + c for c in "€".encode()]
    b = ReasoningBudget(2, START, END, FORCED, vocab)
    feed(b, 1, 2, piece_id("a"), euro[0])
    assert b.state is BudgetState.WAITING_UTF8
    feed(b, euro[1])
    assert b.state is BudgetState.WAITING_UTF8
    feed(b, euro[2])
    assert b.forcing == 9


def test_sampler_params_build_and_prime_the_stage() -> None:
    sp = SamplerParams(reasoning_budget_tokens=2, reasoning_budget_start=START, reasoning_budget_end=END)
    assert SamplerParams().reasoning_budget() is None  # -1: no stage (as common_sampler_init)
    assert SamplerParams(reasoning_budget_tokens=2, reasoning_budget_start=START).reasoning_budget() is None
    stage = sp.reasoning_budget()
    assert stage is not None and stage.state is BudgetState.IDLE
    sp.reasoning_budget_prefill = (5, 1, 2, 7)  # a generation prompt that opens thinking: counted
    stage = sp.reasoning_budget()
    assert stage is not None and stage.state is BudgetState.COUNTING and stage.remaining == 1


def test_prompt_tokens_do_not_move_the_budget() -> None:
    s = Sampler(
        SamplerParams(temp=0, reasoning_budget_tokens=1, reasoning_budget_start=START, reasoning_budget_end=END)
    )
    assert s.budget is not None
    for t in START:
        s.accept(t, generated=False)
    assert s.budget.state is BudgetState.IDLE
    for t in START:
        s.accept(t)
    assert s.budget.state is BudgetState.COUNTING


def test_the_forced_row_is_a_one_token_distribution() -> None:
    """What speculative rejection sampling sees while the budget forces: the forced token alone."""
    sp = SamplerParams(
        seed=1,
        reasoning_budget_tokens=0,
        reasoning_budget_start=START,
        reasoning_budget_end=END,
        reasoning_budget_forced=FORCED,
    )
    s = Sampler(sp)
    for t in START:
        s.accept(t)
    x = s.constrain(torch.randn(40))
    dist = s.distribution(x)
    assert dist is not None
    ids, p = dist
    assert [int(i) for i, q in zip(ids, p) if q > 0] == [9]
    assert s.sample(x) == 9


# -- inside a Generation -------------------------------------------------------------------------


def ids_of(text: str) -> list[int]:
    """The tiny vocabulary's tokens for `text`, one character at a time (no space prefix)."""
    out = []
    for c in text:
        if c == "\n":
            out.append(NEWLINE)
        else:
            try:
                out.append(piece_id(c))
            except ValueError:
                out += [BYTE0 + b for b in c.encode()]
    return out


def favour(vocab: Vocab, tok: int) -> torch.Tensor:
    row = torch.zeros(vocab.n_tokens)
    row[tok] = 10.0
    return row


def run(gen: Generation, script: list[int], limit: int = 200) -> list[int]:
    """Sample rows that favour `script`'s tokens in turn; a forced token does not use one."""
    pos = 0
    for _ in range(limit):
        want = script[pos] if pos < len(script) else EOS
        step = gen.sample(favour(gen.vocab, want))
        if step.token == want:
            pos += 1
        gen.decoded()
        if step.done:
            break
    return gen.tokens


def think_params(vocab: Vocab, n: int, message: str = "", prefill: str = "<think>\n") -> SamplerParams:
    """What the server hands the sampler for a template that opens thinking."""

    def tok(s: str) -> tuple[int, ...]:
        return tuple(vocab.tokenize(s, False, True))

    return SamplerParams(
        temp=0,
        reasoning_budget_tokens=n,
        reasoning_budget_start=tok("<think>"),
        reasoning_budget_end=(tok("</think>"),),
        reasoning_budget_forced=(tok(message) if message else ()) + tok("</think>"),
        reasoning_budget_prefill=tok(prefill),
    )


@pytest.mark.parametrize("message", ["", " ok"])
def test_generation_forces_the_end_tag(tiny_gemma_model: Model, message: str) -> None:
    vocab = tiny_gemma_model.vocab
    sp = think_params(vocab, 4, message)
    gen = Generation(vocab, Sampler(sp, vocab=vocab), GenerationParams(n_predict=30), 512)
    run(gen, [piece_id("a")] * 30)
    # the generation prompt's newline after <think> is the budget's first token, as llama-server counts
    assert gen.text.startswith("aaa" + message + "</think>a")
    assert gen.sampler.budget is not None and gen.sampler.budget.n_forced == len(sp.reasoning_budget_forced)
    m = parse_chat_output(gen.text, thinking_forced_open=True)
    assert m.reasoning_content == ("aaa" + message).strip() and m.content.startswith("a")


def test_generation_ends_naturally_within_the_budget(tiny_gemma_model: Model) -> None:
    vocab = tiny_gemma_model.vocab
    gen = Generation(vocab, Sampler(think_params(vocab, 40), vocab=vocab), GenerationParams(n_predict=30), 512)
    run(gen, ids_of("ab</think>cd"))
    assert gen.text == "ab</think>cd"
    assert gen.sampler.budget is not None and gen.sampler.budget.n_forced == 0


def test_lazy_tool_grammar_engages_after_the_forced_end(tiny_gemma_model: Model) -> None:
    """Hermes calls with tool_choice auto in a template that opens thinking: the grammar waits
    through the thinking block (a `<tool_call>` inside it is not a call), takes the forced
    `</think>` like any token, and engages on the call written after it."""
    vocab = tiny_gemma_model.vocab
    tool = Tool("get_time", "", {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]})
    tg = build_tool_grammar([tool], ToolChoice("auto"), ToolFormat.HERMES, thinking=True, thinking_forced_open=True)
    assert tg is not None and tg.lazy
    params = GenerationParams(n_predict=200, grammar=tg.compile())
    gen = Generation(vocab, Sampler(think_params(vocab, 14), vocab=vocab), params, 1024)
    call = '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    thought = "<tool_call>x"  # 12 tokens: the budget (14, less the prompt's newline) ends inside
    run(gen, ids_of(thought + "y" * 10))
    assert gen.grammar is not None and gen.grammar.awaiting  # nothing in thinking triggered it
    head = gen.text[: gen.text.index("</think>")]
    assert head == thought + "y"  # 13 thinking tokens, then the end was forced
    gen = Generation(vocab, Sampler(think_params(vocab, 14), vocab=vocab), params, 1024)
    run(gen, ids_of(thought + "y" + call))
    assert gen.grammar is not None and not gen.grammar.awaiting  # the call after it engaged it
    assert gen.stop_reason == "eog"
    m = parse_chat_output(gen.text, ToolFormat.HERMES, thinking_forced_open=True)
    assert m.reasoning_content == thought + "y"
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("get_time", {"tz": "UTC"})]
