"""Tool grammars: with tool_choice required or a named function, a tiny random model's output
(greedy and sampled) parses into a call whose arguments validate against the tool's schema; a
lazy grammar leaves the text free until its trigger and constrains it from there."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ubatch.engine.chat.tools import Tool, ToolChoice, ToolFormat, build_tool_grammar, parse_chat_output
from ubatch.engine.completion.complete import CompletionStats, complete
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.grammar import Grammar, compile_grammar
from ubatch.engine.grammar.match import DEAD
from ubatch.engine.grammar.sampler import GrammarSampler
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams

WEATHER = Tool(
    "get_weather",
    "Current weather",
    {
        "type": "object",
        "properties": {
            "location": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["location", "days"],
        "additionalProperties": False,
    },
)
TIME = Tool(
    "get_time", "", {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"]}
)
TOOLS = [WEATHER, TIME]
SCHEMAS = {t.name: t.parameters for t in TOOLS}


@pytest.fixture(scope="module")
def ctx(tiny_llama_model: Model) -> Context:
    return Context(tiny_llama_model, ContextParams(n_ctx=1024))


def generate(ctx: Context, g: Grammar, sp: SamplerParams, n: int = 500) -> tuple[str, str]:
    ctx.memory.clear()
    st = CompletionStats()
    ids = ctx.model.vocab.tokenize("Call a tool:")
    events = complete(ctx, ids, Sampler(sp), GenerationParams(n_predict=n, grammar=g), st)
    return "".join(e.text for e in events), st.stop_reason


@pytest.mark.parametrize(
    "fmt",
    [
        ToolFormat.HERMES,
        ToolFormat.GENERIC,
        ToolFormat.MISTRAL_NEMO,
        ToolFormat.LLAMA3,
    ],  # (Functionary's required grammar lets text come first and Qwen3-Coder's string values are
)  # raw text, as llama.cpp's: a random model may write on until n_predict; see below)
@pytest.mark.parametrize(
    "choice", [ToolChoice("required"), ToolChoice("required", "get_time")], ids=["required", "named"]
)
@pytest.mark.parametrize("sp", [SamplerParams(temp=0), SamplerParams(seed=3, temp=0.8, top_k=8)], ids=["greedy", "hot"])
def test_required_output_is_a_valid_call(ctx: Context, fmt: ToolFormat, choice: ToolChoice, sp: SamplerParams) -> None:
    tg = build_tool_grammar(TOOLS, choice, fmt, parallel=False)
    assert tg is not None and not tg.lazy
    text, stop = generate(ctx, tg.compile(), sp)
    assert stop == "eog", text
    m = parse_chat_output(text, fmt, tools=TOOLS)
    assert len(m.tool_calls) == 1, text
    call = m.tool_calls[0]
    assert choice.name in (None, call.name)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_parallel_grammar_accepts_several_calls() -> None:
    tg = build_tool_grammar(TOOLS, ToolChoice("required"), ToolFormat.HERMES, parallel=True)
    assert tg is not None
    g = compile_grammar(tg.gbnf)
    one = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    assert g.accepts(one) and g.accepts(one + "\n" + one)
    single = compile_grammar(build_tool_grammar(TOOLS, ToolChoice("required"), ToolFormat.HERMES).gbnf)  # type: ignore[union-attr]
    assert single.accepts(one) and not single.accepts(one + "\n" + one)
    assert not g.accepts('<tool_call>\n{"name": "get_time", "arguments": {"tz": 3}}\n</tool_call>')


def test_thinking_block_before_required_calls() -> None:
    tg = build_tool_grammar(TOOLS, ToolChoice("required"), ToolFormat.HERMES, thinking=True)
    g = compile_grammar(tg.gbnf)  # type: ignore[union-attr]
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    assert g.accepts("<think>\nhmm <b> </th\n</think>\n\n" + call) and g.accepts(call)


def test_auto_is_lazy_with_the_formats_trigger() -> None:
    for fmt, word in [(ToolFormat.HERMES, "<tool_call>"), (ToolFormat.MISTRAL_NEMO, "[TOOL_CALLS]")]:
        tg = build_tool_grammar(TOOLS, ToolChoice("auto"), fmt)
        assert tg is not None and tg.lazy and tg.trigger_words == (word,)
    assert build_tool_grammar(TOOLS, ToolChoice("none"), ToolFormat.HERMES) is None
    generic = build_tool_grammar(TOOLS, ToolChoice("auto"), ToolFormat.GENERIC)
    assert generic is not None and not generic.lazy
    assert compile_grammar(generic.gbnf).accepts('{"response": "hello"}')
    coder = build_tool_grammar(TOOLS, ToolChoice("auto"), ToolFormat.QWEN3_CODER)
    assert coder is not None and coder.lazy
    assert coder.trigger_words == ("<tool_call>", "<function=get_weather>", "<function=get_time>")
    thinking = build_tool_grammar(TOOLS, ToolChoice("auto"), ToolFormat.QWEN3_CODER, thinking=True)
    assert thinking is not None and thinking.trigger_patterns and not thinking.trigger_words


WEATHER_XML = (
    '<tool_call>\n<function=get_weather>\n<parameter=location>\nSan Jose, "CA"\n</parameter>\n'
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def test_recipient_and_xml_grammars_accept_the_models_calls() -> None:
    """Functionary's `name\n{...}` after optional text; Qwen3-Coder's XML with a typed value (a
    string written raw, an integer as JSON), the parameters in the schema's order, a bare first call."""
    fn = build_tool_grammar(TOOLS, ToolChoice("required"), ToolFormat.FUNCTIONARY_V3_2, parallel=True)
    g = compile_grammar(fn.gbnf)  # type: ignore[union-attr]
    assert g.accepts('get_time\n{"tz": "CET"}') and g.accepts('all\nOne moment.>>>get_time\n{"tz": "CET"}')
    assert g.accepts('get_time\n{"tz": "CET"}>>>get_weather\n{"location": "Oslo", "days": 2}')
    assert not g.accepts("all\nNo call.") and not g.accepts('get_date\n{"tz": "CET"}')
    lazy = build_tool_grammar(TOOLS, ToolChoice("auto"), ToolFormat.FUNCTIONARY_V3_2)
    assert lazy is not None and lazy.lazy and lazy.trigger_patterns
    xml = compile_grammar(build_tool_grammar(TOOLS, ToolChoice("required"), ToolFormat.QWEN3_CODER).gbnf)  # type: ignore[union-attr]
    assert xml.accepts(WEATHER_XML) and xml.accepts(WEATHER_XML.removeprefix("<tool_call>\n"))
    unit = "<parameter=unit>\ncelsius\n</parameter>\n"
    assert xml.accepts(WEATHER_XML.replace("<parameter=days>", unit + "<parameter=days>"))  # the schema's order
    assert not xml.accepts(WEATHER_XML.replace("</function>", unit + "</function>"))
    assert not xml.accepts(WEATHER_XML.replace("<parameter=days>\n3\n</parameter>\n", ""))  # days is required
    assert not xml.accepts(WEATHER_XML.replace("\n3\n", "\nthree\n"))  # an integer is JSON


def _feed(gs: GrammarSampler, ctx: Context, text: str) -> None:
    """Feed `text` tokenized in one piece (SentencePiece puts a space before each fragment)."""
    for t in ctx.model.vocab.tokenize(text, add_special=False):
        assert gs.allows(t), (text, t)
        gs.accept(t)


def test_lazy_grammar_free_before_trigger_constrained_after(ctx: Context) -> None:
    tg = build_tool_grammar(TOOLS, ToolChoice("auto"), ToolFormat.HERMES)
    assert tg is not None
    g = tg.compile()
    assert g.lazy
    free = "Free text: anything {goes} here! "
    gs = GrammarSampler(g, ctx.model.vocab)
    _feed(gs, ctx, free)
    assert gs.awaiting and gs.accepting
    gs = GrammarSampler(g, ctx.model.vocab)
    _feed(gs, ctx, free + '<tool_call>\n{"name": "get_')
    assert not gs.awaiting and not gs.accepting
    x = gs.table.pieces.index(b"x")
    t = gs.table.pieces.index(b"t")
    assert not gs.allows(x) and gs.allows(t)  # "get_x..." names no tool; "get_t..." does
    gs = GrammarSampler(g, ctx.model.vocab)
    _feed(gs, ctx, free + '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    assert not gs.awaiting and gs.accepting


def test_lazy_generation_parses(ctx: Context) -> None:
    """Greedy generation under a lazy grammar whose trigger the prompt does not force: whatever
    comes out, it parses (as content, or a valid call once triggered)."""
    tg = build_tool_grammar(TOOLS, ToolChoice("auto"), ToolFormat.HERMES)
    text, _ = generate(ctx, tg.compile(), SamplerParams(seed=1), n=60)  # type: ignore[union-attr]
    m = parse_chat_output(text, ToolFormat.HERMES)
    for c in m.tool_calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


def test_harmony_grammar() -> None:
    """GPT-OSS: a call in the channel's header or the role's, with or without a content type,
    after analysis messages when required; lazily engaged by a recipient."""
    req = build_tool_grammar(TOOLS, ToolChoice("required"), ToolFormat.GPT_OSS)
    g = compile_grammar(req.gbnf)  # type: ignore[union-attr]
    args = '<|message|>{"tz": "CET"}'
    assert g.accepts("<|channel|>commentary to=functions.get_time <|constrain|>json" + args)
    assert g.accepts(" to=functions.get_time<|channel|>commentary json" + args)
    thought = "<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant"
    assert g.accepts(thought + "<|channel|>commentary to=functions.get_time" + args)
    assert not g.accepts(thought + "<|channel|>final<|message|>It is noon.")
    assert not g.accepts("<|channel|>commentary to=functions.get_date" + args)
    lazy = build_tool_grammar(TOOLS, ToolChoice("auto"), ToolFormat.GPT_OSS)
    assert lazy is not None and lazy.lazy and len(lazy.trigger_patterns) == 4
    h = lazy.compile()
    assert h.matcher.walk(h.matcher.start, " to=functions.get_t") != DEAD
    assert h.matcher.walk(h.matcher.start, " to=functions.get_x") == DEAD


def test_xml_call_with_json_values_is_generated_whole(ctx: Context) -> None:
    """Qwen3-Coder's required grammar on a tool whose parameters are JSON values (bounded): the
    random model's call ends and parses into arguments valid for the schema."""
    dice = Tool(
        "roll",
        "",
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 6}, "loud": {"type": "boolean"}},
            "required": ["n"],
        },
    )
    tg = build_tool_grammar([dice], ToolChoice("required"), ToolFormat.QWEN3_CODER)
    assert tg is not None
    for sp in (SamplerParams(temp=0), SamplerParams(seed=3, temp=0.8, top_k=8)):
        text, stop = generate(ctx, tg.compile(), sp)
        assert stop == "eog", text
        (call,) = parse_chat_output(text, ToolFormat.QWEN3_CODER, tools=[dice]).tool_calls
        jsonschema.validate(json.loads(call.arguments), dice.parameters)
