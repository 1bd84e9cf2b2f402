"""Reading a JSON schema into nodes: where a malformed schema is refused.

Mirrors llama.cpp's common_chat_schema_from_json: which keywords decide a node's kind and in
what order, how `$ref` paths are followed (same document only, each target built once, cycles
allowed), and the error text, which names the JSON-pointer-like path of the bad part.
"""

from __future__ import annotations

import math
import re

from ubatch.engine.grammar.json_schema.nodes import (
    INT64_MAX,
    INT64_MIN,
    INT_MAX,
    MAX_SCHEMA_DEPTH,
    SIMPLE_TYPES,
    TOO_DEEP,
    AllOfNode,
    AnyNode,
    AnyOfNode,
    ArrayNode,
    ConstNode,
    EnumNode,
    IntegerNode,
    Node,
    ObjectNode,
    Property,
    RefNode,
    SchemaError,
    StringNode,
    TupleNode,
)

_UUID_FORMATS = {"uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
_ARRAY_INDEX = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)", re.ASCII)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fail(path: str, msg: str) -> SchemaError:
    return SchemaError(f"JSON schema conversion failed: JSON schema error at {path}: {msg}")


def _count(schema: dict, key: str, path: str, unbounded: int | None) -> int | None:
    """minItems/maxItems/minLength/maxLength: a non-negative integer (INT_MAX and up: no limit)."""
    if key not in schema:
        return unbounded
    value = schema[key]
    if not _is_int(value) or value < 0:
        raise _fail(path, f"{key} must be a non-negative integer")
    return None if value >= INT_MAX and unbounded is None else value


def _bound(schema: dict, key: str, path: str, round_up: bool) -> int:
    """An integer bound; a fractional one is rounded towards the integers it still admits."""
    value = schema[key]
    if not _is_number(value) or (isinstance(value, float) and math.isnan(value)):
        raise _fail(path, f"{key} must be a number")
    if isinstance(value, float):
        if math.isinf(value):
            return INT64_MAX if value > 0 else INT64_MIN
        value = math.ceil(value) if round_up else math.floor(value)
    return max(INT64_MIN, min(INT64_MAX, value))


def _format(schema: dict, path: str) -> str:
    if "format" not in schema:
        return ""
    value = schema["format"]
    if not isinstance(value, str):
        raise _fail(path, "format must be a string")
    if value in ("date", "time", "date-time"):
        return value
    return "uuid" if value in _UUID_FORMATS else ""


def _array_index(sel: str, size: int) -> int:
    """A path step into an array, read as C's strtoull reads it (a bad one is out of range)."""
    m = _ARRAY_INDEX.match(sel)
    if not m:
        return size
    idx = int(m.group(2))
    return size if m.group(1) == "-" and idx else idx


class _Reader:
    """Walks the schema JSON once, building nodes; every `$ref` target is built exactly once."""

    def __init__(self, root: object) -> None:
        self.root = root
        self.refs: dict[str, Node | None] = {}
        self.pending: list[RefNode] = []
        self.depth = 0  # node() calls in progress (bounded by MAX_SCHEMA_DEPTH)

    def read(self) -> Node:
        node = self.node(self.root, "#")
        for ref in self.pending:
            ref.target = self.refs[ref.ref]
        return node

    def resolve(self, ref: str, path: str) -> object:
        target = self.root
        for sel in ref[1:].split("/")[1:]:
            if isinstance(target, dict) and sel in target:
                target = target[sel]
            elif isinstance(target, list):
                idx = _array_index(sel, len(target))
                if idx >= len(target):
                    raise _fail(path, f"cannot resolve $ref {ref}, {sel} is out of range")
                target = target[idx]
            else:
                raise _fail(path, f"cannot resolve $ref {ref}, {sel} not found")
        return target

    def ref(self, value: object, path: str) -> Node:
        if not isinstance(value, str):
            raise _fail(path, "$ref must be a string")
        if not value.startswith("#/"):
            raise _fail(path, f"unsupported $ref {value}, only references into the same document are supported")
        if value not in self.refs:
            self.refs[value] = None  # taken first, so a cycle back to this $ref stops here
            self.refs[value] = self.node(self.resolve(value, path), value)
        node = RefNode(value)
        self.pending.append(node)
        return node

    def alternatives(self, alts: object, path: str) -> list[Node]:
        if not isinstance(alts, list):
            raise _fail(path, "must be an array of schemas")
        if not alts:
            raise _fail(path, "must not be empty")
        return [self.node(alt, f"{path}/{i}") for i, alt in enumerate(alts)]

    def object_node(self, schema: dict, path: str) -> Node:
        required: set[str] = set()
        if isinstance(schema.get("required"), list):
            required = {name for name in schema["required"] if isinstance(name, str)}
        props: list[Property] = []
        if "properties" in schema:
            properties = schema["properties"]
            if not isinstance(properties, dict):
                raise _fail(path, "properties must be an object")
            for name, prop in properties.items():
                props.append(Property(name, self.node(prop, f"{path}/properties/{name}"), name in required))
        additional: Node | None = None
        if "additionalProperties" in schema:
            extra = schema["additionalProperties"]
            if isinstance(extra, bool):
                additional = AnyNode() if extra else None
            elif isinstance(extra, dict):
                additional = self.node(extra, f"{path}/additionalProperties")
            else:
                raise _fail(path, "additionalProperties must be a boolean or a schema")
        elif "properties" not in schema:
            additional = AnyNode()  # {"type": "object"} alone accepts any object
        return ObjectNode(props, additional)

    def array(self, schema: dict, path: str) -> Node:
        items: Node = AnyNode()
        if "items" in schema or "prefixItems" in schema:
            key = "items" if "items" in schema else "prefixItems"
            value = schema[key]
            if isinstance(value, list):
                return TupleNode([self.node(item, f"{path}/{key}/{i}") for i, item in enumerate(value)])
            items = self.node(value, f"{path}/{key}")
        min_items = _count(schema, "minItems", path, 0)
        return ArrayNode(items, min_items or 0, _count(schema, "maxItems", path, None))

    def string(self, schema: dict, path: str) -> Node:
        pattern = schema.get("pattern", "")
        if not isinstance(pattern, str):
            raise _fail(path, "pattern must be a string")
        fmt = _format(schema, path)
        min_length = _count(schema, "minLength", path, 0) or 0
        return StringNode(pattern, fmt, min_length, _count(schema, "maxLength", path, None))

    def integer(self, schema: dict, path: str) -> Node:
        lo, hi = INT64_MIN, INT64_MAX
        if "minimum" in schema:
            lo = _bound(schema, "minimum", path, round_up=True)
        elif "exclusiveMinimum" in schema:
            lo = min(INT64_MAX, _bound(schema, "exclusiveMinimum", path, round_up=False) + 1)
        if "maximum" in schema:
            hi = _bound(schema, "maximum", path, round_up=False)
        elif "exclusiveMaximum" in schema:
            hi = max(INT64_MIN, _bound(schema, "exclusiveMaximum", path, round_up=True) - 1)
        return IntegerNode(None if lo == INT64_MIN else lo, None if hi == INT64_MAX else hi)

    def node(self, schema: object, path: str) -> Node:
        if self.depth >= MAX_SCHEMA_DEPTH:
            raise SchemaError(TOO_DEEP)
        self.depth += 1
        try:
            return self._node(schema, path)
        finally:
            self.depth -= 1

    def _node(self, schema: object, path: str) -> Node:
        if not isinstance(schema, dict):
            raise _fail(path, "schema must be an object")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path)
        if "oneOf" in schema or "anyOf" in schema:
            key = "oneOf" if "oneOf" in schema else "anyOf"
            return AnyOfNode(self.alternatives(schema[key], f"{path}/{key}"))
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise _fail(path, "type must not be empty")
            alts = [self.node({**schema, "type": t}, f"{path}/type/{i}") for i, t in enumerate(kind)]
            return AnyOfNode(alts)
        if "const" in schema:
            return ConstNode(schema["const"])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise _fail(path, "enum must be a non-empty array")
            return EnumNode(list(values))
        if kind is not None and not isinstance(kind, str):
            raise _fail(path, "type must be a string or an array of strings")
        return self.typed(schema, kind or "", path)

    def typed(self, schema: dict, kind: str, path: str) -> Node:
        extra = schema.get("additionalProperties", True)
        has_properties = "properties" in schema or extra is not True
        if not kind:  # without a type the structural keywords decide, in this order
            if has_properties:
                return self.object_node(schema, path)
            if "allOf" in schema:
                return AllOfNode(self.alternatives(schema["allOf"], f"{path}/allOf"))
            if "items" in schema or "prefixItems" in schema:
                return self.array(schema, path)
            if any(k in schema for k in ("pattern", "minLength", "maxLength")) or _format(schema, path):
                return self.string(schema, path)
            return AnyNode()
        if kind in ("object", "string") and "allOf" in schema and not (kind == "object" and has_properties):
            return AllOfNode(self.alternatives(schema["allOf"], f"{path}/allOf"))
        if kind == "object":
            return self.object_node(schema, path)
        if kind == "string":
            return self.string(schema, path)
        if kind == "array":
            return self.array(schema, path)
        if kind == "integer":
            return self.integer(schema, path)
        if kind in SIMPLE_TYPES:
            return SIMPLE_TYPES[kind]()
        raise _fail(path, f"unrecognized type {kind}")


def read_schema(schema: object) -> Node:
    """The schema as nodes; SchemaError (with the path of the bad part) when it is malformed."""
    return _Reader(schema).read()
