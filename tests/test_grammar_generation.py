"""Grammar-constrained generation on the default model (Gemma 3 270M, 262k tokens), greedy and
sampled: through engine.generate.complete and through a real server on loopback. Every output
must parse; greedy must equal llama.cpp's own output for the same prompt and grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import Live

from ubatch.cli.server.app import ServerOptions, create_app
from ubatch.cli.server.run import start_engine
from ubatch.engine.completion.complete import CompletionStats, complete
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.grammar import Grammar, compile_grammar
from ubatch.engine.grammar.json_schema.convert import schema_to_gbnf
from ubatch.engine.grammar.match import DEAD
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.serve.scheduler import Scheduler

pytestmark = pytest.mark.slow

YES_NO = 'root ::= "yes" | "no"'
# JSON with a nested object (the first member's value), every string and number bounded, so that
# a sampled output always completes well within n_predict
NESTED = r"""
root   ::= "{" ws key ":" ws inner ws ( "," ws pair )? "}"
pair   ::= key ":" ws ( inner | scalar ) ws
inner  ::= "{" ws ( ipair ( "," ws ipair )? )? "}"
ipair  ::= key ":" ws scalar ws
key    ::= "\"" [a-z_]{1,6} "\""
scalar ::= "\"" [A-Za-z ]{0,8} "\"" | "-"? [0-9]{1,4} | "true" | "false" | "null"
ws     ::= [ ]?
"""
JSON_PROMPT = 'A user record as JSON with a nested "address" object:\n'
YES_PROMPT = "Is the sky blue? Answer:"
SAMPLERS = [
    SamplerParams(temp=0),
    SamplerParams(seed=1),
    SamplerParams(seed=5, temp=1.5, top_k=100, top_p=1.0, min_p=0.0),
]
IDS = ["greedy", "seed1", "hot"]


@pytest.fixture(scope="module")
def ctx(default_model: Model) -> Context:
    return Context(default_model, ContextParams(n_ctx=512))


def generate(ctx: Context, prompt: str, g: Grammar, sp: SamplerParams, **kw: Any) -> tuple[str, str]:
    ctx.memory.clear()
    st = CompletionStats()
    ids = ctx.model.vocab.tokenize(prompt)
    events = complete(ctx, ids, Sampler(sp), GenerationParams(n_predict=kw.pop("n", 120), grammar=g, **kw), st)
    return "".join(e.text for e in events), st.stop_reason


def test_greedy_equals_llama_cpp(ctx: Context) -> None:
    """llama-completion -n 120 --temp 0 --grammar-file (same prompt, grammar) printed these."""
    assert generate(ctx, JSON_PROMPT, compile_grammar(NESTED), SAMPLERS[0]) == ('{ "id": {}, "name": "test" }', "eog")
    assert generate(ctx, YES_PROMPT, compile_grammar(YES_NO), SAMPLERS[0]) == ("yes", "eog")


@pytest.mark.parametrize("sp", SAMPLERS, ids=IDS)
def test_yes_or_no(ctx: Context, sp: SamplerParams) -> None:
    text, stop = generate(ctx, "Do cats bark? Reply:", compile_grammar(YES_NO), sp)
    assert text in ("yes", "no") and stop == "eog"


@pytest.mark.parametrize("sp", SAMPLERS, ids=IDS)
def test_nested_json_always_parses(ctx: Context, sp: SamplerParams) -> None:
    g = compile_grammar(NESTED)
    text, stop = generate(ctx, JSON_PROMPT, g, sp)
    obj = json.loads(text)
    assert stop == "eog" and g.accepts(text)
    assert isinstance(obj, dict) and isinstance(next(iter(obj.values())), dict)


def test_a_complete_grammar_ends_generation_even_with_ignore_eos(ctx: Context) -> None:
    """No token can follow "yes": generation ends instead of breaking the grammar."""
    text, stop = generate(ctx, YES_PROMPT, compile_grammar(YES_NO), SAMPLERS[1], ignore_eos=True)
    assert text in ("yes", "no") and stop == "eog"


def test_no_grammar_no_grammar_work(ctx: Context) -> None:
    ctx.memory.clear()
    from ubatch.engine.generation.generation import Generation

    gen = Generation(ctx.model.vocab, Sampler(SAMPLERS[0]), GenerationParams(n_predict=4), 512)
    assert gen.grammar is None  # Generation.sample's only grammar cost is this `is None` test


# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(default_model: Model) -> Iterator[str]:
    ctx = Context(default_model, ContextParams(n_ctx=1024, n_seq_max=2, n_outputs_max=2))
    eng = start_engine(Scheduler(ctx, 2))
    live = Live(create_app(eng, ServerOptions()))
    yield live.url
    live.close()
    eng.stop()


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def viable(g: Grammar, text: str) -> bool:
    """A prefix the grammar can still complete (an output cut by n_predict)."""
    return g.matcher.walk(g.matcher.start, text) != DEAD


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"seed": 9, "temperature": 1.3}])
def test_server_grammar_request(url: str, sampling: dict[str, Any]) -> None:
    r = post(url, "/completion", {"prompt": JSON_PROMPT, "grammar": NESTED, "n_predict": 120, **sampling})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop_type"] == "eos" and body["generation_settings"]["grammar"] == NESTED
    assert isinstance(json.loads(body["content"]), dict)


def test_server_grammar_fan_out_and_stream(url: str) -> None:
    r = post(url, "/completion", {"prompt": YES_PROMPT, "grammar": YES_NO, "n": 2, "seed": 4})
    assert r.status_code == 200 and all(c["content"] in ("yes", "no") for c in r.json()), r.text
    body = {"prompt": YES_PROMPT, "grammar": YES_NO, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/completion", json=body, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["content"] for e in events) == "yes" and events[-1]["stop"]


@pytest.mark.parametrize(
    "grammar,needle",
    [
        ("root ::= this is (not valid GBNF", "expecting ')'"),
        ("root ::= nowhere", "undefined rule 'nowhere'"),
        ('start ::= "a"', "'root'"),
    ],
)
def test_server_bad_grammar_is_a_400_and_the_server_stays_healthy(url: str, grammar: str, needle: str) -> None:
    r = post(url, "/completion", {"prompt": "hi", "grammar": grammar, "n_predict": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "Failed to initialize samplers" in err["message"]
    assert needle in err["message"]
    ok = post(url, "/completion", {"prompt": "hi", "n_predict": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["tokens_predicted"] == 2


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat(url: str, response_format: dict[str, Any], **kw: Any) -> httpx.Response:
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    return post(url, "/v1/chat/completions", {"messages": msgs, "response_format": response_format, **kw})


def test_openai_response_format(url: str) -> None:
    r = chat(url, {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, max_tokens=80, seed=2)
    assert r.status_code == 200, r.text
    obj = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(obj) == {"name", "age"} and len(obj["name"]) <= 8 and obj["age"] <= 150
    r = chat(url, {"type": "json_object"}, max_tokens=16, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content, g = choice["message"]["content"], compile_grammar(schema_to_gbnf({"type": "object"}))
    assert g.accepts(content) if choice["finish_reason"] == "stop" else viable(g, content), content
    bad = chat(url, {"type": "sound"})
    assert bad.status_code == 400 and "response_format type must be one of" in bad.json()["error"]["message"]
    bad = chat(url, {"type": "json_object", "schema": {"type": "hiccup"}})
    assert bad.status_code == 400 and '"json_schema"' in bad.json()["error"]["message"]
