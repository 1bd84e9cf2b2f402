"""Object schemas as GBNF: required keys in schema order, then any subset of the optional ones.

Optional properties keep their order too: each one may be followed only by those after it
(the `-rest` rules), and extra keys (`additionalProperties`) come last, spelled so they cannot
repeat a declared name (`not_strings`). The builder sees the converter only through `Rules`, the
three calls it makes, so this file needs nothing of convert.py.
"""

from __future__ import annotations

from typing import Protocol

from ubatch.engine.grammar.json_schema.nodes import AnyNode, Node
from ubatch.engine.grammar.json_schema.rules import dump_json, format_literal

_ADDITIONAL = "*"  # the key standing for additionalProperties among the optional ones


class Rules(Protocol):
    """What the object builder asks of the converter (convert.Converter)."""

    def add_rule(self, name: str, rule: str) -> str:
        """Add a named rule; returns the name it got."""
        ...

    def builtin(self, name: str) -> str:
        """Add a shared builtin rule (`char`, `string`, `value`, ...); returns its name."""
        ...

    def visit(self, node: Node, name: str) -> str:
        """Add the rules for a schema node; returns the rule that matches it."""
        ...


def not_strings(conv: Rules, strings: list[str]) -> str:
    """A rule body matching any JSON string except the given ones (a trie over their characters)."""
    trie: list[tuple[dict[str, int], list[bool]]] = [({}, [False])]
    for word in strings:
        node = 0
        for ch in word:
            children = trie[node][0]
            if ch not in children:
                children[ch] = len(trie)
                trie.append(({}, [False]))
            node = children[ch]
        trie[node][1][0] = True
    char = conv.builtin("char")
    out: list[str] = ['["] ( ']

    def visit(idx: int) -> None:
        children = trie[idx][0]
        for n, ch in enumerate(sorted(children)):
            if n:
                out.append(" | ")
            out.append(f"[{ch}]")
            child = children[ch]
            if trie[child][0]:
                out.append(" (")
                visit(child)
                out.append(")")
            else:
                out.append(f" {char}+")
        if children:
            out.append(f' | [^"{"".join(sorted(children))}] {char}*')

    visit(0)
    out.append(" )")
    if not trie[0][1][0]:
        out.append("?")
    out.append(' ["]')
    return "".join(out)


def build_object_rule(
    conv: Rules, properties: list[tuple[str, Node]], required: set[str], name: str, additional: Node | None
) -> str:
    """The rule body for an object with these properties (and extra keys when `additional`)."""
    prefix = name + "-" if name else ""
    required_props: list[str] = []
    optional_props: list[str] = []
    kv_rules: dict[str, str] = {}
    names: list[str] = []
    for prop_name, prop_schema in properties:
        value_rule = conv.visit(prop_schema, prefix + prop_name)
        kv_rules[prop_name] = conv.add_rule(
            f"{prefix}{prop_name}-kv", format_literal(dump_json(prop_name)) + ' space ":" space ' + value_rule
        )
        (required_props if prop_name in required else optional_props).append(prop_name)
        names.append(prop_name)
    if additional is not None:
        sub_name = prefix + "additional"
        if isinstance(additional, AnyNode):
            value_rule = conv.builtin("value")
        else:
            value_rule = conv.visit(additional, f"{sub_name}-value")
        key_rule = conv.add_rule(f"{sub_name}-k", not_strings(conv, names)) if names else conv.builtin("string")
        kv_rules[_ADDITIONAL] = conv.add_rule(f"{sub_name}-kv", f'{key_rule} ":" space {value_rule}')
        optional_props.append(_ADDITIONAL)

    if not required_props and not optional_props:
        return '"{" space "}"'

    def rest_of(keys: list[str], first_is_optional: bool) -> str:
        """Keys in order, each optional after the first; extra keys may repeat."""
        key = keys[0]
        kv = kv_rules[key]
        comma_ref = f'( "," space {kv} )'
        if first_is_optional:
            res = comma_ref + ("*" if key == _ADDITIONAL else "?")
        else:
            res = kv + (f" {comma_ref}*" if key == _ADDITIONAL else "")
        if len(keys) > 1:
            res += " " + conv.add_rule(f"{prefix}{key}-rest", rest_of(keys[1:], True))
        return res

    rule = '"{" space ' + ' "," space '.join(kv_rules[k] for k in required_props)
    if optional_props:
        rule += " ("
        if required_props:
            rule += ' "," space ( '
        rule += " | ".join(rest_of(optional_props[i:], False) for i in range(len(optional_props)))
        if required_props:
            rule += " )"
        rule += " )?"
    return rule + ' space "}"'
