"""The limits that keep one grammar from stalling the process, and the compile-time check.

A GBNF grammar is cheap to parse but can be ruinous to match: a repetition of a rule that is
itself a repetition (`root ::= r{0,2000}` with `r ::= "a"{0,2000}`, which a JSON-schema pattern
`^(a{0,2000}){0,2000}$` becomes) expands to millions of elements, and its matcher states to
thousands of stacks each. The parser already refuses a repetition of a big inline group
(llama.cpp's rule); `check_expansion` multiplies the bounds through rule references too, so the
nesting is refused at compile time, wherever it is spelled. What static counting cannot see
(ambiguity, e.g. `(a | a)` nested deep) the matcher bounds as it goes (match.py).
"""

from __future__ import annotations

from ubatch.engine.grammar.elements import GrammarError

# Compile time: the most elements one expansion of the root may hold, counting nested
# repetition through rule references (`x{0,n}` multiplies x's own size by n). The grammars
# JSON schemas make stay far below (a 2000-character string is 8,000; an array of 50 objects
# with 2000-character strings 400,000); the nested-pattern probe is 4,000,000.
MAX_EXPANSION = 1_000_000
# Compile time: the elements all repetitions may add (`"a"{2000}` is 2,000 copies; a grammar of
# many such items would fill gigabytes from a small text). A 20,000-item anyOf schema is 500,000.
MAX_GRAMMAR_ELEMENTS = 2_000_000

# Matching: one state (the set of stacks a text can be in) larger than this, or one step that
# builds more stacks than MAX_STEP_WORK, means a grammar so ambiguous that every token costs
# seconds; an enum of 20,000 values is one stack per value, well under.
MAX_STATE_STACKS = 50_000
MAX_STEP_WORK = 400_000
# Compile time, when asked (compile_grammar(probe=True), GrammarCache): the matcher walks this
# many characters along its largest states, so that a grammar ambiguous from its start (the
# usual shape: a pattern's nested repetition) is refused before a request runs it rather than
# mid-generation. Milliseconds for sane grammars.
PROBE_STEPS = 16

# Matching memory: the stack entries one matcher may keep interned (states and expansion
# caches, about 130 bytes each) before it drops them at the next token and re-derives what it
# needs (~26 MiB; the JSON grammar reaches that after some 150 documents), plus
# MATCHER_ENTRIES_PER_ELEMENT per element of the grammar (a 20,000-value enum has states of
# 20,000 stacks: it must keep a few), and what all live matchers together may keep before idle
# ones are dropped (~130 MiB).
MAX_MATCHER_ENTRIES = 200_000
MATCHER_ENTRIES_PER_ELEMENT = 2
MAX_TOTAL_ENTRIES = 1_000_000
ENTRY_BYTES = 130  # measured with tracemalloc over JSON documents: for size estimates

_SATURATE = 10**15  # sizes past this are all "too large": keeps the arithmetic small

Term = tuple[int, int]  # (multiplier, referenced rule id or -1 for a terminal) of one item


def check_expansion(terms: dict[int, list[Term]], names: dict[int, str], root: int) -> None:
    """GrammarError when the rules reachable from `root` expand to more than MAX_EXPANSION
    elements. A rule's size is the largest of its items' multiplier x referenced size; inside a
    recursive cycle a reference counts as the cycle's largest non-recursive size (one level of
    recursion), since each further level needs more input to be reached."""
    size: dict[int, int] = {}
    for comp in _cycles(terms, root):
        members = set(comp)
        base = {
            r: max([1] + [_mul(m, size[t] if t >= 0 else 1) for m, t in terms.get(r, []) if t not in members])
            for r in comp
        }
        inner = max(base.values())
        for r in comp:
            size[r] = max([base[r]] + [_mul(m, inner) for m, t in terms.get(r, []) if t in members])
    total = size[root]
    if total > MAX_EXPANSION:
        raise GrammarError(
            f"grammar too large: nested repetition in rule '{names.get(root, root)}' expands to ~{total:,} "
            f"elements (limit {MAX_EXPANSION:,}); simplify the pattern or lower its bounds"
        )


def _mul(a: int, b: int) -> int:
    return min(a * b, _SATURATE)


def _cycles(terms: dict[int, list[Term]], root: int) -> list[list[int]]:
    """The strongly connected components of the reference graph reachable from `root`, each
    after every component it references (Tarjan's algorithm, with an explicit stack so a chain
    of thousands of rules costs no recursion)."""
    index: dict[int, int] = {root: 0}
    low: dict[int, int] = {root: 0}
    stack, on_stack, out = [root], {root}, []
    work = [(root, 0)]
    succs: dict[int, list[int]] = {}
    while work:
        v, k = work[-1]
        succ = succs.get(v)
        if succ is None:
            succ = succs[v] = [t for _, t in terms.get(v, []) if t >= 0]
        if k < len(succ):
            work[-1] = (v, k + 1)
            w = succ[k]
            if w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, 0))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
            continue
        work.pop()
        if work:
            u = work[-1][0]
            low[u] = min(low[u], low[v])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)
    return out
