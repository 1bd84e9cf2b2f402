"""The sampler fields of a llama-server request body that are not plain numbers:
`dry_sequence_breakers` and `samplers`, checked as server-schema.cpp checks them.

`samplers` is an array of names or a string of --sampling-seq characters; names llama.cpp does
not know are dropped, as llama-server drops them, and any other JSON type keeps the default.
"""

from __future__ import annotations

from typing import Any

from ubatch.cli.server.http import bad_request
from ubatch.engine.sampling.names import UNSUPPORTED_SAMPLERS, sampler_types_from_chars, sampler_types_from_names

_JSON_TYPE = {bool: "boolean", int: "number", float: "number", dict: "object", list: "array", type(None): "null"}


def get_breakers(body: dict[str, Any], default: tuple[str, ...]) -> tuple[str, ...]:
    v = body.get("dry_sequence_breakers")
    if v is None:
        return default
    if not isinstance(v, list) or not v or not all(isinstance(s, str) for s in v):
        raise bad_request(
            "Field 'dry_sequence_breakers': Error: dry_sequence_breakers must be a non-empty array of strings"
        )
    return tuple(v)


def get_samplers(body: dict[str, Any], default: tuple[str, ...]) -> tuple[str, ...]:
    v = body.get("samplers")
    if isinstance(v, list):
        for name in v:
            if not isinstance(name, str):
                kind = _JSON_TYPE.get(type(name), "object")
                raise bad_request(
                    f"Field 'samplers': [json.exception.type_error.302] type must be string, but is {kind}"
                )
        out = sampler_types_from_names(v, strict=False)
    elif isinstance(v, str):
        out = sampler_types_from_chars(v, strict=False)
    else:
        return default
    for name in out:
        if name in UNSUPPORTED_SAMPLERS:
            raise bad_request(f"Field 'samplers': the '{name}' sampler is not supported by this server")
    return out
