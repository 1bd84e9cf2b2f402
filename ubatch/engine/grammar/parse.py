"""GBNF text -> rules of elements (elements.py), with llama.cpp's syntax and its rewrites: groups
and repetitions become generated rules (`name_N`) as in llama.cpp, so a grammar accepts the same
strings and fails at the same places. Errors are one line: the problem, its line and column."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ubatch.engine.grammar.budget import MAX_GRAMMAR_ELEMENTS, Term, check_expansion
from ubatch.engine.grammar.elements import (
    ALT,
    CHAR,
    CHAR_ALT,
    CHAR_ANY,
    CHAR_NOT,
    CHAR_RNG_UPPER,
    END,
    RULE_REF,
    TOKEN,
    TOKEN_NOT,
    GrammarError,
    ParsedGrammar,
    Rule,
)

MAX_REPETITION = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
HEX_LEN = {"x": 2, "u": 4, "U": 8}


@dataclass(slots=True)
class _Group:
    """A rule body or a parenthesised group being parsed: its elements so far, the item a
    repetition operator would apply to, and the repetition terms (budget.py) of the rule."""

    rule_id: int
    nested: bool  # inside parentheses: newlines are spaces
    before: int = 0  # the symbol count before the group's rule was generated
    rule: Rule = field(default_factory=list)
    last: int = 0  # where the item a repetition operator applies to starts
    n_prev: int = 1  # rules that item expands to (bounds the size of repeated groups)
    item: list[Term] = field(default_factory=list)  # the item's terms, multiplied by repetitions
    terms: list[Term] = field(default_factory=list)  # the finished items' terms

    def item_start(self, n_prev: int, item: list[Term]) -> None:
        self.flush()
        self.last, self.n_prev, self.item = len(self.rule), n_prev, item

    def flush(self) -> None:
        self.terms += self.item
        self.item = []


def is_word(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9") or c == "-"


class Parser:
    """One pass over the text; `tokenize` resolves <text> token references (None: not allowed)."""

    def __init__(self, text: str, tokenize: Callable[[str], list[int]] | None = None) -> None:
        self.src, self.n, self.tokenize = text, len(text), tokenize
        self.symbols: dict[str, int] = {}
        self.rules: list[Rule | None] = []
        self.terms: dict[int, list[Term]] = {}  # rule id -> its repetition terms (budget.py)
        self.n_repeated = 0  # elements repetitions added (bounded by MAX_GRAMMAR_ELEMENTS)
        self.repeats: list[tuple[int, Rule]] = []  # each repetition's first optional rule, and its item

    # -- helpers -------------------------------------------------------------------------------

    def at(self, i: int) -> str:
        return self.src[i] if i < self.n else ""

    def fail(self, what: str, i: int) -> GrammarError:
        line = self.src.count("\n", 0, i) + 1
        col = i - (self.src.rfind("\n", 0, i) + 1) + 1
        near = self.src[i : i + 24].split("\n")[0]
        where = f" at line {line}, column {col}" + (f" ({near!r})" if near else " (end of input)")
        return GrammarError(f"failed to parse grammar: {what}{where}")

    def space(self, i: int, newline_ok: bool) -> int:
        while i < self.n:
            c = self.src[i]
            if c == "#":
                while i < self.n and self.src[i] not in "\r\n":
                    i += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                i += 1
            else:
                break
        return i

    def name(self, i: int) -> int:
        j = i
        while j < self.n and is_word(self.src[j]):
            j += 1
        if j == i:
            raise self.fail("expecting name", i)
        return j

    def digit(self, i: int) -> bool:
        return self.at(i).isascii() and self.at(i).isdigit()

    def integer(self, i: int) -> tuple[int, int]:
        j = i
        while self.digit(j):
            j += 1
        if j == i:
            raise self.fail("expecting integer", i)
        return int(self.src[i:j]), j

    def char(self, i: int) -> tuple[int, int]:
        """One character of a literal or class: itself, or an escape (\\n, \\xHH, \\uHHHH...)."""
        c = self.at(i)
        if c == "\\":
            e = self.at(i + 1)
            if e in HEX_LEN:
                size, j, value = HEX_LEN[e], i + 2, 0
                while j < i + 2 + size and j < self.n and self.src[j] in "0123456789abcdefABCDEF":
                    value, j = value * 16 + int(self.src[j], 16), j + 1
                if j != i + 2 + size:
                    raise self.fail(f"expecting {size} hex chars", i + 2)
                return value, j
            if e and e in ESCAPES:
                return ESCAPES[e], i + 2
            raise self.fail("unknown escape", i)
        if c:
            return ord(c), i + 1
        raise self.fail("unexpected end of input", i)

    def symbol(self, name: str) -> int:
        return self.symbols.setdefault(name, len(self.symbols))

    def generated(self, base: str) -> int:
        n = len(self.symbols)
        self.symbols[f"{base}_{n}"] = n
        return n

    def add_rule(self, rule_id: int, rule: Rule) -> None:
        self.rules.extend([None] * (rule_id + 1 - len(self.rules)))
        self.rules[rule_id] = rule

    # -- grammar -------------------------------------------------------------------------------

    def parse(self) -> ParsedGrammar:
        i = self.space(0, True)
        while i < self.n:
            i = self.rule(i)
        if not self.rules:
            raise GrammarError("failed to parse grammar: the grammar has no rules")
        names = {v: k for k, v in self.symbols.items()}
        for rule in self.rules:
            for t, v in rule or ():
                if t == RULE_REF and (v >= len(self.rules) or self.rules[v] is None):
                    raise GrammarError(f"failed to parse grammar: undefined rule '{names[v]}'")
        if "root" not in self.symbols:
            raise GrammarError("grammar does not contain a 'root' rule")
        rules = [r if r is not None else [(END, 0)] for r in self.rules]
        check_expansion(self.terms, names, self.symbols["root"])
        heads = tuple(head for head, _ in self.repeats)
        return ParsedGrammar(rules, dict(self.symbols), self.symbols["root"], heads, self.ambiguous(rules))

    def ambiguous(self, rules: list[Rule]) -> tuple[int, ...]:
        """The repetitions whose item is only references to rules that can match the empty text."""
        items = [(head, [v for _, v in item]) for head, item in self.repeats if all(t == RULE_REF for t, _ in item)]
        if not items:
            return ()
        empty = nullable_rules(rules, [r for _, refs in items for r in refs])
        return tuple(head for head, refs in items if all(r in empty for r in refs))

    def rule(self, i: int) -> int:
        j = self.name(i)
        name = self.src[i:j]
        rule_id = self.symbol(name)
        i = self.space(j, False)
        if self.src[i : i + 3] != "::=":
            raise self.fail("expecting ::=", i)
        i = self.alternates(self.space(i + 3, True), name, rule_id, False)
        if self.at(i) == "\r":
            i += 2 if self.at(i + 1) == "\n" else 1
        elif self.at(i) == "\n":
            i += 1
        elif i < self.n:
            raise self.fail("expecting newline or end", i)
        return self.space(i, True)

    def alternates(self, i: int, name: str, rule_id: int, nested: bool) -> int:
        """The alternatives of a rule body, up to its end: groups `( ... )` are followed with an
        explicit stack of open groups, not by recursion, so nesting depth costs no Python frames."""
        open_groups = [_Group(rule_id, nested)]
        while True:
            group = open_groups[-1]
            i, opened = self.sequence(i, name, group)
            if opened:  # a "(": its alternatives become a generated rule, parsed next
                before = len(self.symbols)
                open_groups.append(_Group(self.generated(name), True, before))
                continue
            group.flush()
            if self.at(i) == "|":
                group.rule.append((ALT, 0))
                group.last, group.n_prev = len(group.rule), 1
                i = self.space(i + 1, True)
                continue
            group.rule.append((END, 0))
            self.add_rule(group.rule_id, group.rule)
            self.terms[group.rule_id] = group.terms
            if len(open_groups) == 1:
                return i
            open_groups.pop()
            outer = open_groups[-1]
            outer.item_start(max(1, len(self.symbols) - group.before), [(1, group.rule_id)])
            outer.rule.append((RULE_REF, group.rule_id))
            if self.at(i) != ")":
                raise self.fail("expecting ')'", i)
            i = self.space(i + 1, outer.nested)

    def sequence(self, i: int, name: str, group: _Group) -> tuple[int, bool]:
        """Items up to the end of a sequence, or up to a "(" (then True, past it): the caller
        parses the group and comes back to this sequence."""
        rule, nested = group.rule, group.nested
        while i < self.n:
            c = self.src[i]
            if c == '"':
                i = i + 1
                group.item_start(1, [(1, -1)])
                while self.at(i) != '"':
                    if i >= self.n:
                        raise self.fail("unexpected end of input", i)
                    cp, i = self.char(i)
                    rule.append((CHAR, cp))
                i = self.space(i + 1, nested)
            elif c == "[":
                i, kind = i + 1, CHAR
                if self.at(i) == "^":
                    i, kind = i + 1, CHAR_NOT
                group.item_start(1, [(1, -1)])
                last = group.last
                while self.at(i) != "]":
                    if i >= self.n:
                        raise self.fail("unexpected end of input", i)
                    cp, i = self.char(i)
                    rule.append((CHAR_ALT if last < len(rule) else kind, cp))
                    if self.at(i) == "-" and self.at(i + 1) != "]":
                        if i + 1 >= self.n:
                            raise self.fail("unexpected end of input", i + 1)
                        cp, i = self.char(i + 1)
                        rule.append((CHAR_RNG_UPPER, cp))
                i = self.space(i + 1, nested)
            elif c in "<!":
                kind = TOKEN
                if c == "!":
                    kind, i = TOKEN_NOT, i + 1
                tok, i = self.token(i)
                group.item_start(1, [(1, -1)])
                i = self.space(i, nested)
                rule.append((kind, tok))
            elif is_word(c):
                j = self.name(i)
                ref = self.symbol(self.src[i:j])
                i = self.space(j, nested)
                group.item_start(1, [(1, ref)])
                rule.append((RULE_REF, ref))
            elif c == "(":
                return self.space(i + 1, True), True
            elif c == ".":
                group.item_start(1, [(1, -1)])
                i = self.space(i + 1, nested)
                rule.append((CHAR_ANY, 0))
            elif c in "*+?":
                at = i
                i = self.space(i + 1, nested)
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                self.repeat(group, lo, hi, name, at)
            elif c == "{":
                at = i
                lo, hi, i = self.braces(self.space(i + 1, nested), nested)
                self.repeat(group, lo, hi, name, at)
            else:
                break
        return i, False

    def braces(self, i: int, nested: bool) -> tuple[int, int | None, int]:
        """{m}, {m,} or {m,n}: (m, n or None, the position after)."""
        if not self.digit(i):
            raise self.fail("expecting an int", i)
        lo, i = self.integer(i)
        i = self.space(i, nested)
        hi: int | None = None
        if self.at(i) == "}":
            hi, i = lo, self.space(i + 1, nested)
        elif self.at(i) == ",":
            i = self.space(i + 1, nested)
            if self.digit(i):
                hi, i = self.integer(i)
                i = self.space(i, nested)
            if self.at(i) != "}":
                raise self.fail("expecting '}'", i)
            i = self.space(i + 1, nested)
        else:
            raise self.fail("expecting ','", i)
        if lo > MAX_REPETITION:
            raise self.fail(f"more than {MAX_REPETITION} repetitions", i)
        if hi is not None and hi > MAX_REPETITION:
            hi = None  # llama.cpp: a maximum beyond the threshold means no maximum
        return lo, hi, i

    def repeat(self, group: _Group, lo: int, hi: int | None, name: str, at: int) -> None:
        """S{m,n} -> S repeated m times, then n-m nested optional rules (S{m,}: one recursive rule)."""
        rule, last = group.rule, group.last
        if last == len(rule):
            raise self.fail("expecting preceding item to */+/?/{", at)
        item = rule[last:]
        total = hi if hi is not None and hi > 0 else max(lo, 1)
        if group.n_prev * total > MAX_REPETITION:
            raise self.fail("the repetition expands to too many rules; reduce the repetitions", at)
        n_opt = 1 if hi is None else hi - lo
        self.n_repeated += len(item) * (lo + n_opt) + 3 * n_opt
        if self.n_repeated > MAX_GRAMMAR_ELEMENTS:
            raise GrammarError(
                f"grammar too large: its repetitions expand to more than {MAX_GRAMMAR_ELEMENTS:,} elements "
                f"(at line {self.src.count(chr(10), 0, at) + 1}); lower the repetition counts"
            )
        del rule[last:]
        rule.extend(item * lo)
        prev_id = 0
        for k in range(n_opt):
            rid = self.generated(name)
            rec = list(item)
            if k > 0 or hi is None:
                rec.append((RULE_REF, rid if hi is None else prev_id))
            self.add_rule(rid, rec + [(ALT, 0), (END, 0)])
            prev_id = rid
        if n_opt > 0:
            rule.append((RULE_REF, prev_id))
            self.repeats.append((prev_id, item))
        group.n_prev *= total
        group.item = [(mult * total, ref) for mult, ref in group.item]

    def token(self, i: int) -> tuple[int, int]:
        """<[id]> or <text> (text that the vocabulary tokenizes to exactly one token)."""
        if self.at(i) != "<":
            raise self.fail("expecting '<'", i)
        j = i + 1
        if self.at(j) == "[":
            tok, j = self.integer(j + 1)
            if tok > 0xFFFFFFFF:
                raise self.fail("token id is too big", j)
            for k, want in ((j, "]"), (j + 1, ">")):
                if self.at(k) != want:
                    raise self.fail(f"expecting '{want}'", k)
            return tok, j + 2
        if self.tokenize is None:
            raise self.fail("no vocabulary to resolve the token", i)
        end = self.src.find(">", j)
        if end < 0:
            raise self.fail("expecting '>'", self.n)
        ids = self.tokenize(self.src[i : end + 1])
        if len(ids) != 1:
            raise self.fail(f"invalid token '{self.src[i : end + 1]}' (not exactly one token)", i)
        return ids[0], end + 1


def nullable_rules(rules: list[Rule], starts: list[int]) -> set[int]:
    """The rules that can match the empty text, among those reachable from `starts` through
    alternatives made only of references (one with a terminal never matches nothing): a
    worklist over that part of the grammar, so its cost is the size of the part."""
    alts: list[tuple[int, list[int]]] = []  # (rule, its references) of each all-reference alternative
    users: dict[int, list[int]] = {}  # rule -> the alternatives that reference it (once per reference)
    seen, todo, empty = set(starts), list(starts), []
    while todo:
        r = todo.pop()
        refs: list[int] | None = []
        for kind, value in rules[r]:
            if kind in (ALT, END):
                if refs is not None:
                    if not refs:
                        empty.append(r)
                    else:
                        alts.append((r, refs))
                        for x in refs:
                            users.setdefault(x, []).append(len(alts) - 1)
                            if x not in seen:
                                seen.add(x)
                                todo.append(x)
                refs = []
            elif kind == RULE_REF and refs is not None:
                refs.append(value)
            else:
                refs = None
    need = [len(refs) for _, refs in alts]
    out: set[int] = set()
    while empty:
        r = empty.pop()
        if r in out:
            continue
        out.add(r)
        for a in users.get(r, ()):
            need[a] -= 1
            if need[a] == 0:
                empty.append(alts[a][0])
    return out


def parse_gbnf(text: str, tokenize: Callable[[str], list[int]] | None = None) -> ParsedGrammar:
    """GBNF text -> rules; GrammarError (one line, with line and column) if it does not parse."""
    return Parser(text, tokenize).parse()
