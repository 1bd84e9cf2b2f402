"""What a compiled GBNF grammar is made of: llama.cpp's element types and the parsed rules.

A rule is a list of (type, value) elements: alternatives separated by ALT, closed by END, so the
matcher walks them by position as llama.cpp's does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ubatch.engine.errors import UbatchError

# element types, in llama.cpp's order (llama_gretype)
END, ALT, RULE_REF, CHAR, CHAR_NOT, CHAR_RNG_UPPER, CHAR_ALT, CHAR_ANY, TOKEN, TOKEN_NOT = range(10)
SEQ_END = (END, ALT)  # what closes a sequence: the rule's end or the next alternative
TOKEN_REFS = (TOKEN, TOKEN_NOT)  # `<token>` and `!<token>`: match one token by id

Rule = list[tuple[int, int]]


class GrammarError(UbatchError):
    """A GBNF grammar (or JSON schema) that does not parse, that the matcher cannot run (left
    recursion), or that is past one of budget.py's limits: always the client's fault, one line."""


@dataclass(slots=True)
class ParsedGrammar:
    rules: list[Rule]
    symbols: dict[str, int]  # rule name -> rule id (generated rules included)
    root: int
    repeats: tuple[int, ...] = ()  # the first optional rule of each repetition with optional parts
    # those of repetitions whose item can match the empty text (`(a{0,9}){0,9}`): ambiguous
    ambiguous: tuple[int, ...] = ()
