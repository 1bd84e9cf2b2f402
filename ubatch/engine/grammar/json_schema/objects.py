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
    # depth first with an explicit stack, as a long key makes a deep trie: (node, its
    # characters in order, how many of them are written)
    todo: list[tuple[int, list[str], int]] = [(0, sorted(trie[0][0]), 0)]
    while todo:
        idx, keys, n = todo.pop()
        if n < len(keys):
            todo.append((idx, keys, n + 1))
            child = trie[idx][0][keys[n]]
            out.append(f"{' | ' if n else ''}[{keys[n]}]")
            if trie[child][0]:
                out.append(" (")
                todo.append((child, sorted(trie[child][0]), 0))
            else:
                out.append(f" {char}+")
            continue
        if keys:
            out.append(f' | [^"{"".join(keys)}] {char}*')
        if todo:  # the " (" its parent opened
            out.append(")")
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

    def head(key: str, first_is_optional: bool) -> str:
        """A key's own part: optional after the first, extra keys repeating."""
        kv = kv_rules[key]
        comma_ref = f'( "," space {kv} )'
        if first_is_optional:
            return comma_ref + ("*" if key == _ADDITIONAL else "?")
        return kv + (f" {comma_ref}*" if key == _ADDITIONAL else "")

    # rest[j]: the rule for the optional keys after key j, built from the last one back (in the
    # order llama.cpp adds them, innermost first) without a recursion per property
    n_opt = len(optional_props)
    rest: list[str] = [""] * n_opt
    for j in range(n_opt - 2, -1, -1):
        tail = head(optional_props[j + 1], True) + (" " + rest[j + 1] if rest[j + 1] else "")
        rest[j] = conv.add_rule(f"{prefix}{optional_props[j]}-rest", tail)

    def rest_of(j: int) -> str:
        """Keys j.. in order, the first required, each later one optional."""
        return head(optional_props[j], False) + (" " + rest[j] if rest[j] else "")

    rule = '"{" space ' + ' "," space '.join(kv_rules[k] for k in required_props)
    if optional_props:
        rule += " ("
        if required_props:
            rule += ' "," space ( '
        rule += " | ".join(rest_of(i) for i in range(n_opt))
        if required_props:
            rule += " )"
        rule += " )?"
    return rule + ' space "}"'
