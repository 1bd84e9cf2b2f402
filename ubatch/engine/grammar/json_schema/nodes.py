"""The typed nodes a JSON schema is read into before any grammar is built.

llama.cpp first turns the schema JSON into a small document model, one node kind per thing the
converter can express (read.py builds it), and only then emits rules, so
the converter never type-checks raw JSON values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ubatch.engine.grammar.elements import GrammarError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT_MAX = 2**31 - 1

# How deep schemas may nest (objects in arrays in objects..., $ref chains included): reading and
# converting recurse once per level, a few Python frames each, and must stay well inside the
# interpreter's recursion limit (1000) whatever stack the caller already uses. Real schemas
# nest a dozen levels.
MAX_SCHEMA_DEPTH = 128
TOO_DEEP = f"JSON schema conversion failed: the schema is nested too deeply (more than {MAX_SCHEMA_DEPTH} levels)"


class SchemaError(GrammarError):
    """The JSON schema cannot be turned into a grammar (one line, names the part at fault). A
    GrammarError: a schema is a grammar by another name, and is refused the same way."""


@dataclass
class AnyNode:
    """Constrains nothing: any JSON value."""


@dataclass(eq=False)
class RefNode:
    """A `$ref` into the same document; `target` is filled in once every reference is built."""

    ref: str
    target: Node | None = field(default=None, repr=False)


@dataclass
class AnyOfNode:
    """oneOf / anyOf, or a list of types (one alternative per type)."""

    children: list[Node]


@dataclass
class AllOfNode:
    children: list[Node]


@dataclass
class ConstNode:
    value: object


@dataclass
class EnumNode:
    values: list[object]


@dataclass
class NullNode:
    pass


@dataclass
class BooleanNode:
    pass


@dataclass
class NumberNode:
    pass


@dataclass
class IntegerNode:
    """Inclusive bounds (exclusive ones folded in); None is unbounded."""

    minimum: int | None = None
    maximum: int | None = None


@dataclass
class StringNode:
    pattern: str = ""
    format: str = ""  # "", "uuid", "date", "time" or "date-time"
    min_length: int = 0
    max_length: int | None = None


@dataclass
class ArrayNode:
    items: Node
    min_items: int = 0
    max_items: int | None = None


@dataclass
class TupleNode:
    items: list[Node]


@dataclass
class Property:
    name: str
    schema: Node
    required: bool


@dataclass
class ObjectNode:
    properties: list[Property]  # in schema order
    additional: Node | None  # None: no other keys allowed


Node = (
    AnyNode
    | RefNode
    | AnyOfNode
    | AllOfNode
    | ConstNode
    | EnumNode
    | NullNode
    | BooleanNode
    | NumberNode
    | IntegerNode
    | StringNode
    | ArrayNode
    | TupleNode
    | ObjectNode
)
SimpleNode = NullNode | BooleanNode | NumberNode  # a type keyword with nothing more to check
SIMPLE_TYPES: dict[str, type[SimpleNode]] = {"number": NumberNode, "boolean": BooleanNode, "null": NullNode}
