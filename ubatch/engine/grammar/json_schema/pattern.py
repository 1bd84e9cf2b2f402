"""A JSON-schema `pattern` (an anchored regular expression) as GBNF rules.

Only the regex subset with a direct grammar equivalent is translated (literals, `.`, groups,
alternation, classes, `* + ? {m,n}`), as llama.cpp's converter does; anything else raises
UnsupportedPattern (the caller falls back to any string, with a warning) and a regex that is
broken under any flavour raises InvalidPattern (the conversion fails).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ubatch.engine.grammar.json_schema.nodes import INT_MAX
from ubatch.engine.grammar.json_schema.rules import build_repetition

MAX_PATTERN_DEPTH = 100
_NON_LITERAL = set("|.()[]{}*+?^$")
_ESCAPED_IN_REGEX_ONLY = set("^$.[](){}|*+?")  # "\x" means the plain character x
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_SIMPLE_ESCAPES = set('trn\\"[]-')  # the escapes GBNF itself reads
_HEX = set("0123456789abcdefABCDEF")
_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", re.ASCII)


class UnsupportedPattern(Exception):
    """A valid regex with no grammar equivalent."""


class InvalidPattern(Exception):
    """Not a valid regex at all."""


def gbnf_escape_length(pattern: str, pos: int) -> int:
    """How long the escape at `pos` is if GBNF reads it the same way, else 0."""
    if pos + 1 >= len(pattern) or pattern[pos] != "\\":
        return 0
    kind = pattern[pos + 1]
    if kind in _SIMPLE_ESCAPES:
        return 2
    n_hex = _HEX_ESCAPES.get(kind, 0)
    if not n_hex or pos + 2 + n_hex > len(pattern):
        return 0
    return 2 + n_hex if all(h in _HEX for h in pattern[pos + 2 : pos + 2 + n_hex]) else 0


def _stoi(text: str) -> int:
    """A repeat count read as C's stoi reads it (leading blanks, trailing junk ignored)."""
    m = _STOI.match(text)
    if not m or not -INT_MAX - 1 <= int(m.group(1)) <= INT_MAX:
        raise UnsupportedPattern("invalid number in curly brackets")
    return int(m.group(1))


# one element of a sequence: its text and whether it is a bare literal (merged with neighbours)
_Item = tuple[str, bool]


def _to_rule(item: _Item) -> str:
    return f'"{item[0]}"' if item[1] else item[0]


class _PatternReader:
    def __init__(self, pattern: str, name: str, add_rule: Callable[[str, str], str]) -> None:
        self.p = pattern
        self.name = name
        self.add_rule = add_rule
        self.i = 0
        self.depth = 0
        self.sub_rule_ids: dict[str, str] = {}

    def join(self, seq: list[_Item]) -> _Item:
        """The sequence as one rule body, consecutive literals merged into one."""
        out: list[_Item] = []
        literal = ""
        for text, is_literal in seq:
            if is_literal:
                literal += text
                continue
            if literal:
                out.append((literal, True))
                literal = ""
            out.append((text, False))
        if literal:
            out.append((literal, True))
        return " ".join(_to_rule(item) for item in out), False

    def sequence(self) -> _Item:
        """Read up to the `)` that closes the current group (or the end)."""
        p, seq = self.p, []
        while self.i < len(p):
            c = p[self.i]
            if c == ".":
                seq.append((self.add_rule("dot", "[^\\x0A\\x0D]"), False))
                self.i += 1
            elif c == "(":
                self.i += 1
                if p.startswith("?", self.i):
                    if not p.startswith("?:", self.i):
                        raise UnsupportedPattern("unsupported group syntax")
                    self.i += 2
                self.depth += 1
                if self.depth > MAX_PATTERN_DEPTH:
                    raise UnsupportedPattern("pattern nesting too deep")
                seq.append(("(" + _to_rule(self.sequence()) + ")", False))
            elif c == ")":
                self.i += 1
                if self.depth == 0:
                    raise InvalidPattern("unbalanced parentheses")
                self.depth -= 1
                return self.join(seq)
            elif c in "^$":
                raise UnsupportedPattern("anchor inside the pattern")
            elif c == "[":
                seq.append((self.char_class(), False))
            elif c == "|":
                seq.append(("|", False))
                self.i += 1
            elif c in "*+?":
                if not seq:
                    raise InvalidPattern("nothing to repeat")
                seq[-1] = (_to_rule(seq[-1]) + c, False)
                self.i += 1
            elif c == "{":
                self.repeat(seq)
            else:
                seq.append((self.literal(c), True))
        return self.join(seq)

    def char_class(self) -> str:
        p, out = self.p, "["
        self.i += 1
        while self.i < len(p) and p[self.i] != "]":
            if p[self.i] == "\\":
                n = gbnf_escape_length(p, self.i)
                if not n:
                    raise UnsupportedPattern(f"unsupported escape in character class: {p[self.i : self.i + 2]}")
                out += p[self.i : self.i + n]
                self.i += n
            else:
                out += p[self.i]
                self.i += 1
        if self.i >= len(p):
            raise InvalidPattern("unterminated character class")
        self.i += 1
        return out + "]"

    def repeat(self, seq: list[_Item]) -> None:
        p = self.p
        end = p.find("}", self.i + 1)
        if end < 0:
            raise UnsupportedPattern("unterminated curly brackets")
        nums = p[self.i + 1 : end].split(",")
        self.i = end + 1
        if len(nums) not in (1, 2):
            raise UnsupportedPattern("wrong number of values in curly brackets")
        if len(nums) == 1:
            lo = hi = _stoi(nums[0])
        else:
            lo = _stoi(nums[0]) if nums[0] else 0
            hi = _stoi(nums[1]) if nums[1] else INT_MAX
        if not seq:
            raise InvalidPattern("nothing to repeat")
        sub, is_literal = seq[-1]
        if not is_literal:
            if sub not in self.sub_rule_ids:
                self.sub_rule_ids[sub] = ""
                self.sub_rule_ids[sub] = self.add_rule(f"{self.name}-{len(self.sub_rule_ids)}", sub)
            sub = self.sub_rule_ids[sub]
        item = f'"{sub}"' if is_literal else sub
        seq[-1] = (build_repetition(item, lo, None if hi == INT_MAX else hi), False)

    def literal(self, c: str) -> str:
        """A run of plain characters; the last one stays apart when a quantifier follows it."""
        p, n, out = self.p, len(self.p), ""
        while self.i < n:
            ch = p[self.i]
            if ch == "\\":
                if self.i == n - 1:
                    raise InvalidPattern("trailing backslash")
                if p[self.i + 1] in _ESCAPED_IN_REGEX_ONLY:
                    out += p[self.i + 1]
                    self.i += 2
                    continue
                k = gbnf_escape_length(p, self.i)
                if not k:
                    raise UnsupportedPattern(f"unsupported escape: {p[self.i : self.i + 2]}")
                out += p[self.i : self.i + k]
                self.i += k
            elif ch == '"':
                out += '\\"'
                self.i += 1
            elif ch not in _NON_LITERAL and (
                self.i == n - 1 or not out or p[self.i + 1] == "." or p[self.i + 1] not in _NON_LITERAL
            ):
                out += ch
                self.i += 1
            else:
                break
        if not out:  # nothing was taken, e.g. a stray "]" or "}"
            raise UnsupportedPattern(f"unsupported character: {c}")
        return out


def pattern_to_rule(pattern: str, name: str, add_rule: Callable[[str, str], str]) -> str:
    """Add the rules for a string matching `pattern`; returns the name of the rule added."""
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
        raise UnsupportedPattern("not anchored with '^' and '$'")
    reader = _PatternReader(pattern[1:-1], name, add_rule)
    body = _to_rule(reader.sequence())
    if reader.depth != 0:
        raise InvalidPattern("unbalanced parentheses")
    return add_rule(name, '"\\"" (' + body + ') "\\""')
