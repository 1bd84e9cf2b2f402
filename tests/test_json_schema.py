"""JSON schema -> GBNF, compared as text with what llama.cpp's converter emits.

`llama_cases.json` holds every case of llama.cpp's tests/test-json-schema-to-grammar.cpp (the
schema and the exact grammar); `extra_cases.json` holds further schemas with the grammar (or
the error) llama.cpp's json_schema_to_grammar gave for them, covering the corners its own
tests skip (float constants, $ref paths, reserved names, pattern fallbacks, malformed schemas).
An error's text is llama.cpp's with its line breaks joined (one line here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ubatch.engine.errors import UbatchError
from ubatch.engine.grammar import compile_grammar
from ubatch.engine.grammar.json_schema.convert import SchemaError, convert_schema, schema_to_gbnf

DATA = Path(__file__).parent / "data" / "json_schema"


def _cases(name: str) -> list:
    cases = json.loads((DATA / name).read_text(encoding="utf-8"))
    return [pytest.param(c, id=c["name"]) for c in cases]


def _check(case: dict) -> None:
    if case["ok"]:
        assert schema_to_gbnf(case["schema"]) == case["expected"]
    else:
        with pytest.raises(SchemaError) as err:
            schema_to_gbnf(case["schema"])
        assert str(err.value) == case["expected"]


@pytest.mark.parametrize("case", _cases("llama_cases.json"))
def test_llama_cpp_cases(case: dict) -> None:
    _check(case)


@pytest.mark.parametrize("case", _cases("extra_cases.json"))
def test_more_cases_against_llama_cpp(case: dict) -> None:
    _check(case)


def test_case_files_cover_successes_and_failures() -> None:
    """Guards the data itself: a truncated file would make the parametrized tests vacuous."""
    llama = json.loads((DATA / "llama_cases.json").read_text(encoding="utf-8"))
    extra = json.loads((DATA / "extra_cases.json").read_text(encoding="utf-8"))
    assert len(llama) == 81 and sum(not c["ok"] for c in llama) == 3
    assert len(extra) >= 80 and sum(not c["ok"] for c in extra) >= 20


def test_empty_schema_is_any_json_value() -> None:
    gbnf = schema_to_gbnf({})
    assert gbnf.splitlines()[8] == "root ::= value"
    assert "value ::= object | array | string | number | boolean | null\n" in gbnf


def test_unsupported_pattern_accepts_any_string_with_a_warning() -> None:
    result = convert_schema({"type": "string", "pattern": "^[0-9]{3}\\w$"})
    assert "root ::= string\n" in result.gbnf
    assert "root-1" not in result.gbnf  # the partial conversion's rules are dropped
    assert result.warnings == ["pattern ^[0-9]{3}\\w$ is not supported (unsupported escape: \\w), accepting any string"]
    assert convert_schema({"type": "string", "pattern": "^a+$"}).warnings == []


def test_errors_are_one_line_user_errors() -> None:
    schema = {"properties": {"a": {"type": "string", "pattern": "^(a$"}, "b": {"type": "string", "pattern": "^*$"}}}
    with pytest.raises(UbatchError) as err:
        schema_to_gbnf(schema)
    assert isinstance(err.value, SchemaError)
    assert "\n" not in str(err.value)
    assert str(err.value) == (
        "JSON schema conversion failed: Invalid pattern ^(a$: unbalanced parentheses; "
        "Invalid pattern ^*$: nothing to repeat"
    )


def test_deep_nesting_is_a_schema_error_not_a_crash() -> None:
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match="nested too deeply"):
        schema_to_gbnf(schema)


def test_every_emitted_grammar_compiles() -> None:
    """The grammar parser (engine/grammar) reads every grammar this converter writes."""
    n = 0
    for name in ("llama_cases.json", "extra_cases.json"):
        for case in json.loads((DATA / name).read_text(encoding="utf-8")):
            if case["ok"]:
                compile_grammar(schema_to_gbnf(case["schema"]))
                n += 1
    assert n > 140


@pytest.mark.parametrize("lo,hi", [(-123, 42), (15, 300), (None, -5), (7, None), (-1000, None), (None, 100)])
def test_integer_range_grammar_matches_exactly_the_range(lo: int | None, hi: int | None) -> None:
    schema: dict = {"type": "integer"}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    grammar = compile_grammar(schema_to_gbnf(schema))
    wrong = [
        n
        for n in range(-1100, 1100)
        if grammar.accepts(str(n)) != ((lo is None or n >= lo) and (hi is None or n <= hi))
    ]
    assert wrong == []
    assert not grammar.accepts("007")


def test_object_grammar_accepts_what_the_schema_allows() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "format": "date"}},
        "required": ["a"],
        "additionalProperties": {"type": "boolean"},
    }
    grammar = compile_grammar(schema_to_gbnf(schema))
    for text in (
        '{"a": 1}',
        '{"a":1,"b":"2024-02-29"}',
        '{"a":1,"c":true}',
        '{ "a": 1, "b": "2024-01-01", "zz": false }',
    ):
        assert grammar.accepts(text), text
    for text in (
        '{"b":"2024-01-01"}',
        '{"a":1,"b":"2024-13-01"}',
        '{"a":1,"a":true}',
        '{"a":1,"c":3}',
        '{"b":"2024-01-01","a":1}',
    ):
        assert not grammar.accepts(text), text
