"""A request's grammar (`grammar`, `json_schema`, OpenAI `response_format`), compiled by the HTTP
layer: a grammar that does not parse is llama-server's 400 before any slot is taken, and the
engine thread never parses text.

The same few grammars tend to come back request after request (one schema per client), so
compiled grammars are kept by text: their matcher's states, filled in by earlier generations,
make the next request's first tokens as cheap as its last. The cache is bounded by the memory
its grammars hold, not by their count, and it probes each new grammar's first steps, so an
ambiguous one is a 400 when it arrives rather than a failure in the middle of a generation.
"""

from __future__ import annotations

from typing import Any

from ubatch.cli.server.http import bad_request, type_name
from ubatch.engine.errors import UbatchError
from ubatch.engine.grammar import Grammar, GrammarCache, GrammarError
from ubatch.engine.grammar.budget import WorkCancelled
from ubatch.engine.grammar.json_schema.convert import SchemaError, schema_to_gbnf

_CACHE = GrammarCache()


def compile_request_grammar(text: str) -> Grammar:
    """GBNF text -> Grammar, or llama-server's 400 for a grammar that does not parse or is
    past the grammar budget (a cancelled compile stays WorkCancelled: the caller answers it)."""
    try:
        return _CACHE.get(text)
    except WorkCancelled:
        raise
    except GrammarError as e:
        raise sampler_error(e) from None


def sampler_error(e: GrammarError) -> Exception:
    """The 400 of a grammar the samplers cannot use: the same words wherever it was built."""
    return bad_request(f"Failed to initialize samplers: {e}")


def schema_grammar(schema: Any) -> str:
    """A JSON schema's GBNF; an empty schema means any object, as in llama-server. A schema
    that does not convert is a 400 naming `json_schema`; a pattern refused by the grammar budget
    (checked as it converts) the grammar's 400."""
    if isinstance(schema, dict) and not schema:
        schema = {"type": "object"}
    try:
        return schema_to_gbnf(schema)
    except WorkCancelled:
        raise
    except SchemaError as e:
        raise bad_request(f'"json_schema": {e}') from None
    except GrammarError as e:
        raise sampler_error(e) from None
    except UbatchError as e:
        raise bad_request(f'"json_schema": {e}') from None


def request_grammar(body: dict[str, Any], default: Grammar | None = None) -> Grammar | None:
    """server-schema.cpp: `json_schema` unless a `grammar` is given too; an empty or absent
    grammar keeps the server's default (--grammar, --json-schema). JSON null is absent."""
    text, schema = body.get("grammar"), body.get("json_schema")
    if text is not None and not isinstance(text, str):
        raise bad_request(f"Field 'grammar': expected a string, got {type_name(text)}")
    if schema is not None and text is None:
        text = schema_grammar(schema)
    return compile_request_grammar(text) if text else default


def response_format_schema(body: dict[str, Any]) -> Any:
    """OpenAI chat's response_format as the json_schema it stands for (None: no constraint).
    json_object: its `schema`, or any object; json_schema: json_schema.schema."""
    rf = body.get("response_format")
    rf = rf if isinstance(rf, dict) else {}
    kind = rf.get("type")
    kind = kind if isinstance(kind, str) else None  # llama.cpp reads a non-string type as ""
    if kind == "json_object":
        return rf.get("schema") if rf.get("schema") is not None else body.get("json_schema") or {}
    if kind == "json_schema":
        wrapper = rf.get("json_schema")
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        return {} if schema is None else schema
    if kind not in (None, "", "text"):
        raise bad_request(f'response_format type must be one of "text" or "json_object", but got: {kind}')
    return body.get("json_schema")
