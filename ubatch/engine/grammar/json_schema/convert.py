"""JSON schema -> GBNF grammar, as llama.cpp's json_schema_to_grammar builds it.

Used for `--json-schema`, a request's `json_schema` and OpenAI `response_format`. The grammar
text matches llama.cpp's rule for rule (names, order, spacing): rules are named after the
schema path that made them, shared builtins (`string`, `number`, ...) are added once, and the
grammar lists them sorted by name. The schema is first read into nodes
(read.py), which is where malformed schemas are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ubatch.engine.grammar.json_schema import nodes
from ubatch.engine.grammar.json_schema.ints import int_range_rule
from ubatch.engine.grammar.json_schema.nodes import MAX_SCHEMA_DEPTH, TOO_DEEP, Node, SchemaError
from ubatch.engine.grammar.json_schema.objects import build_object_rule
from ubatch.engine.grammar.json_schema.pattern import InvalidPattern, UnsupportedPattern, pattern_to_rule
from ubatch.engine.grammar.json_schema.pattern_check import check_pattern
from ubatch.engine.grammar.json_schema.read import read_schema
from ubatch.engine.grammar.json_schema.rules import (
    PRIMITIVE_RULES,
    RESERVED_NAMES,
    SPACE_RULE,
    STRING_FORMAT_RULES,
    BuiltinRule,
    build_repetition,
    dump_json,
    format_literal,
    rule_name,
)

__all__ = ["SchemaError", "SchemaGrammar", "convert_schema", "schema_to_gbnf"]

_SIMPLE_NAMES = {cls: name for name, cls in nodes.SIMPLE_TYPES.items()}


@dataclass
class SchemaGrammar:
    """A converted schema: the grammar, and what was loosened on the way (unsupported patterns)."""

    gbnf: str
    warnings: list[str] = field(default_factory=list)


def _constant(value: object) -> str:
    return format_literal(dump_json(value))


class Converter:
    """Accumulates named rules while visiting the schema nodes."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {"space": SPACE_RULE}
        self.refs_being_resolved: set[str] = set()
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.depth = 0  # visit() calls in progress (bounded by MAX_SCHEMA_DEPTH)

    def add_rule(self, name: str, rule: str) -> str:
        """Add `rule` as `name` (or `name0`, `name1`, ... when that name holds another rule)."""
        esc = rule_name(name)
        if self.rules.get(esc, rule) == rule:
            self.rules[esc] = rule
            return esc
        i = 0
        while self.rules.get(f"{esc}{i}", rule) != rule:
            i += 1
        self.rules[f"{esc}{i}"] = rule
        return f"{esc}{i}"

    def add_primitive(self, name: str, rule: BuiltinRule) -> str:
        added = self.add_rule(name, rule.content)
        for dep in rule.deps:
            dep_rule = PRIMITIVE_RULES.get(dep) or STRING_FORMAT_RULES.get(dep)
            if dep_rule is None:
                self.errors.append(f"Rule {dep} not known")
            elif dep not in self.rules:
                self.add_primitive(dep, dep_rule)
        return added

    def builtin(self, name: str) -> str:
        return self.add_primitive(name, PRIMITIVE_RULES[name])

    def primitive(self, name: str, kind: str) -> str:
        return self.add_primitive("root" if name == "root" else kind, PRIMITIVE_RULES[kind])

    def pattern(self, pattern: str, name: str) -> str:
        """The pattern's rules, checked on their own for ambiguity (pattern_check.py): a
        GrammarError names a pattern too ambiguous to match."""
        snapshot = dict(self.rules)
        added: list[str] = []

        def add_rule(name: str, rule: str) -> str:
            added.append(self.add_rule(name, rule))
            return added[-1]

        try:
            top = pattern_to_rule(pattern, name, add_rule)
            check_pattern(pattern, {n: self.rules[n] for n in added}, top)
            return top
        except UnsupportedPattern as e:
            self.rules = snapshot
            self.warnings.append(f"pattern {pattern} is not supported ({e}), accepting any string")
            return self.add_rule(name, self.builtin("string"))
        except InvalidPattern as e:
            self.rules = snapshot
            self.errors.append(f"Invalid pattern {pattern}: {e}")
            return ""

    def resolve_ref(self, node: nodes.RefNode) -> str:
        fragment = node.ref[node.ref.find("#") + 1 :]
        name = "ref" + rule_name(fragment)
        if name not in self.rules and node.ref not in self.refs_being_resolved:
            if node.target is None:
                self.errors.append(f"Unresolved $ref {node.ref}")
                return ""
            self.refs_being_resolved.add(node.ref)
            name = self.visit(node.target, name)
            self.refs_being_resolved.discard(node.ref)
        return name

    def all_of(self, node: nodes.AllOfNode, name: str, rule: str) -> str:
        """Merge the parts: object properties (required unless under anyOf) and enum values."""
        required: set[str] = set()
        properties: list[tuple[str, Node]] = []
        enum_counts: dict[str, int] = {}

        def add(comp: Node, is_required: bool) -> None:
            if isinstance(comp, nodes.RefNode):
                if comp.target is not None:
                    add(comp.target, is_required)
            elif isinstance(comp, nodes.ObjectNode):
                for prop in comp.properties:
                    properties.append((prop.name, prop.schema))
                    if is_required:
                        required.add(prop.name)
            elif isinstance(comp, nodes.EnumNode):
                for value in comp.values:
                    lit = _constant(value)
                    enum_counts[lit] = enum_counts.get(lit, 0) + 1

        for child in node.children:
            if isinstance(child, nodes.AnyOfNode):
                for alt in child.children:
                    add(alt, False)
            else:
                add(child, True)
        common = [lit for lit in sorted(enum_counts) if enum_counts[lit] == len(node.children)]
        if common:
            return self.add_rule(rule, "(" + " | ".join(common) + ")")
        return self.add_rule(rule, build_object_rule(self, properties, required, name, None))

    def visit(self, node: Node, name: str) -> str:
        """Add the rules for `node`; returns the rule name that matches it."""
        if self.depth >= MAX_SCHEMA_DEPTH:  # $ref chains can nest deeper than the schema text
            raise SchemaError(TOO_DEEP)
        self.depth += 1
        try:
            return self._visit(node, name)
        finally:
            self.depth -= 1

    def _visit(self, node: Node, name: str) -> str:
        rule = name + "-" if name in RESERVED_NAMES else name or "root"
        sub_name = name + "-" if name else ""
        if isinstance(node, nodes.RefNode):
            return self.add_rule(rule, self.resolve_ref(node))
        if isinstance(node, nodes.AnyOfNode):
            prefix = name + "-" if name else "alternative-"
            alts = [self.visit(alt, f"{prefix}{i}") for i, alt in enumerate(node.children)]
            return self.add_rule(rule, " | ".join(alts))
        if isinstance(node, nodes.AllOfNode):
            return self.all_of(node, name, rule)
        if isinstance(node, nodes.ConstNode):
            return self.add_rule(rule, _constant(node.value))
        if isinstance(node, nodes.EnumNode):
            return self.add_rule(rule, "(" + " | ".join(_constant(v) for v in node.values) + ")")
        if isinstance(node, nodes.ObjectNode):
            if not node.properties and isinstance(node.additional, nodes.AnyNode):
                return self.add_rule(rule, self.builtin("object"))
            props = [(p.name, p.schema) for p in node.properties]
            required = {p.name for p in node.properties if p.required}
            return self.add_rule(rule, build_object_rule(self, props, required, name, node.additional))
        if isinstance(node, nodes.TupleNode):
            items = [self.visit(item, f"{sub_name}tuple-{i}") for i, item in enumerate(node.items)]
            return self.add_rule(rule, '"[" space ' + ' "," space '.join(items) + ' space "]"')
        if isinstance(node, nodes.ArrayNode):
            if isinstance(node.items, nodes.AnyNode) and node.min_items == 0 and node.max_items is None:
                return self.primitive(rule, "array")
            item = self.visit(node.items, f"{sub_name}item")
            body = build_repetition(item, node.min_items, node.max_items, '"," space')
            return self.add_rule(rule, f'"[" space {body} space "]"')
        if isinstance(node, nodes.StringNode):
            return self.string(node, rule)
        if isinstance(node, nodes.IntegerNode):
            if node.minimum is None and node.maximum is None:
                return self.primitive(rule, "integer")
            return self.add_rule(rule, int_range_rule(node.minimum, node.maximum))
        if isinstance(node, nodes.AnyNode):
            return self.add_rule(rule, self.builtin("value"))
        return self.primitive(rule, _SIMPLE_NAMES[type(node)])

    def string(self, node: nodes.StringNode, rule: str) -> str:
        if node.pattern:
            return self.pattern(node.pattern, rule)
        if node.format == "uuid":
            return self.primitive(rule, "uuid")
        if node.format:
            prim = f"{node.format}-string"
            return self.add_rule(rule, self.add_primitive(prim, STRING_FORMAT_RULES[prim]))
        if node.min_length > 0 or node.max_length is not None:
            char = self.builtin("char")
            return self.add_rule(rule, '"\\"" ' + build_repetition(char, node.min_length, node.max_length) + ' "\\""')
        return self.primitive(rule, "string")

    def grammar(self) -> str:
        return "".join(f"{name} ::= {self.rules[name]}\n" for name in sorted(self.rules))


def convert_schema(schema: dict | bool) -> SchemaGrammar:
    """The grammar for `schema`, with the warnings llama.cpp prints; SchemaError when it cannot."""
    try:
        converter = Converter()
        converter.visit(read_schema(schema), "")
    except RecursionError:  # a deep const value, or a caller already deep in its stack
        raise SchemaError(TOO_DEEP) from None
    if converter.errors:
        raise SchemaError("JSON schema conversion failed: " + "; ".join(converter.errors))
    return SchemaGrammar(converter.grammar(), converter.warnings)


def schema_to_gbnf(schema: dict | bool) -> str:
    """GBNF text for a JSON schema ({} is any JSON value; a bare boolean is refused, as in llama.cpp)."""
    return convert_schema(schema).gbnf
