"""The fixed GBNF pieces a JSON-schema grammar is built from, and the text helpers that quote them.

The rule bodies are llama.cpp's, character for character: a grammar is compared as text (the
tests, a user's saved grammar, llama-server's `/props`), so the same schema must give the same
rules. Constants are JSON text as nlohmann::json writes it, hence `dump_json`
(`json_float.py` for its doubles).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ubatch.engine.grammar.json_schema.json_float import format_double

SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'


@dataclass(frozen=True)
class BuiltinRule:
    content: str
    deps: tuple[str, ...] = ()


PRIMITIVE_RULES: dict[str, BuiltinRule] = {
    "boolean": BuiltinRule('("true" | "false")'),
    "decimal-part": BuiltinRule("[0-9]{1,16}"),
    "integral-part": BuiltinRule("[0] | [1-9] [0-9]{0,15}"),
    "number": BuiltinRule(
        '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?', ("integral-part", "decimal-part")
    ),
    "integer": BuiltinRule('("-"? integral-part)', ("integral-part",)),
    "value": BuiltinRule(
        "object | array | string | number | boolean | null", ("object", "array", "string", "number", "boolean", "null")
    ),
    "object": BuiltinRule(
        '"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"', ("string", "value")
    ),
    "array": BuiltinRule('"[" space ( value ("," space value)* )? space "]"', ("value",)),
    "uuid": BuiltinRule(
        '"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12} "\\""'
    ),
    "char": BuiltinRule('[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})'),
    "string": BuiltinRule('"\\"" char* "\\""', ("char",)),
    "null": BuiltinRule('"null"'),
}

STRING_FORMAT_RULES: dict[str, BuiltinRule] = {
    "date": BuiltinRule('[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )'),
    "time": BuiltinRule(
        '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )?'
        ' ( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )'
    ),
    "date-time": BuiltinRule('date "T" time', ("date", "time")),
    "date-string": BuiltinRule('"\\"" date "\\""', ("date",)),
    "time-string": BuiltinRule('"\\"" time "\\""', ("time",)),
    "date-time-string": BuiltinRule('"\\"" date-time "\\""', ("date-time",)),
}

# a schema part with one of these names gets a "-" appended, so it cannot shadow a builtin
RESERVED_NAMES = frozenset({"root", *PRIMITIVE_RULES, *STRING_FORMAT_RULES})

_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_LITERAL_ESCAPE_RE = re.compile(r'[\r\n"\\]')
_INVALID_RULE_CHARS_RE = re.compile(r"[^a-zA-Z0-9-]+")


def format_literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return '"' + _LITERAL_ESCAPE_RE.sub(lambda m: _LITERAL_ESCAPES[m.group()], text) + '"'


def rule_name(name: str) -> str:
    """A name made of the characters GBNF allows in rule names (each other run becomes "-")."""
    return _INVALID_RULE_CHARS_RE.sub("-", name)


def dump_json(value: object) -> str:
    """Compact JSON text as nlohmann::json's dump() writes it (used for const and enum values)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if -(2**63) <= value < 2**64:
            return str(value)
        try:
            return format_double(float(value))  # nlohmann reads wider integers as doubles
        except OverflowError:
            return "null"
    if isinstance(value, float):
        return format_double(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dump_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{dump_json(str(k))}:{dump_json(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def build_repetition(item: str, min_items: int, max_items: int | None, separator: str = "") -> str:
    """`item` repeated min..max times (None: no upper limit), optionally separated."""
    if max_items == 0:
        return ""
    if min_items == 0 and max_items == 1:
        return f"{item}?"
    if not separator:
        if min_items == 1 and max_items is None:
            return f"{item}+"
        if min_items == 0 and max_items is None:
            return f"{item}*"
        return f"{item}{{{min_items},{'' if max_items is None else max_items}}}"
    rest_max = None if max_items is None else max_items - 1
    result = f"{item} " + build_repetition(f"({separator} {item})", min_items - 1 if min_items else 0, rest_max)
    return f"({result})?" if min_items == 0 else result
