"""llama.cpp refuses left-recursive grammars: a rule that can reach itself again without
consuming text would make the matcher's stacks grow without end. Checked once at compile time."""

from __future__ import annotations

from ubatch.engine.grammar.elements import RULE_REF, SEQ_END, GrammarError, ParsedGrammar


def check_left_recursion(g: ParsedGrammar) -> None:
    """llama.cpp refuses left-recursive rules (a rule reachable from its own start without
    consuming text): the stacks would grow without end. Depth-first, without recursion, so a
    chain of thousands of generated repetition rules is fine."""
    n = len(g.rules)
    visited, active, nullable = [False] * n, [False] * n, [False] * n
    names = {v: k for k, v in g.symbols.items()}

    def enter(r: int) -> None:
        active[r], at_start = True, True
        for kind, _ in g.rules[r]:
            if kind in SEQ_END:
                if at_start:
                    nullable[r] = True  # an empty alternative (as llama.cpp, not via references)
                    return
                at_start = True
            else:
                at_start = False

    for r0 in range(n):
        if visited[r0]:
            continue
        enter(r0)
        todo = [(r0, 0, True)]  # (rule, element to look at next, still at the left edge)
        while todo:
            r, i, leftmost = todo.pop()
            rule, descended = g.rules[r], False
            while i < len(rule):
                kind, value = rule[i]
                if kind == RULE_REF and leftmost:
                    if active[value]:
                        raise GrammarError(f"unsupported grammar: left recursion in rule '{names.get(value, value)}'")
                    if not visited[value]:
                        todo += [(r, i, leftmost), (value, 0, True)]
                        enter(value)
                        descended = True
                        break
                    leftmost = nullable[value]
                else:
                    leftmost = kind in SEQ_END
                i += 1
            if not descended:
                active[r], visited[r] = False, True
