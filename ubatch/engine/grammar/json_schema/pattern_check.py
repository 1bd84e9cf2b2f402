"""The matching check of a JSON-schema `pattern`, run where the pattern is converted.

A pattern is the one part of a schema in which a client spells arbitrary nested repetition, and
`((a{0,100}){0,100}){0,100}` is within the static expansion limit while each `a` can be in a
million places. The whole grammar's compile-time probe only walks its first characters, and a
pattern inside a tool's parameters (or deep in an object) comes later: a generation met it
mid-way and stalled its slot. So each pattern's own grammar is compiled and probed as it is
converted, from its start and from each of its bounded repetitions (so no literal text before a
nesting hides it), with the matcher's budgets (budget.py), wherever the schema comes from;
outcomes are kept by pattern text, so a client's schema costs the check once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ubatch.engine.grammar.budget import WorkCancelled, probing_turn
from ubatch.engine.grammar.elements import GrammarError
from ubatch.engine.grammar.match import Matcher
from ubatch.engine.grammar.parse import parse_gbnf

MAX_KEPT = 1024  # patterns whose outcome is remembered
_SHOWN = 80  # characters of a refused pattern quoted in its error

_kept: OrderedDict[str, str] = OrderedDict()  # pattern -> "" (fine) or the refusal's message
_lock = threading.Lock()


def check_pattern(pattern: str, rules: dict[str, str], top: str) -> None:
    """GrammarError when the grammar of `pattern` (its `rules`, the string rule `top` among
    them) is too ambiguous to match within the budgets: the same probe a request's grammar gets."""
    with _lock:
        msg = _kept.get(pattern)
        if msg is not None:
            _kept.move_to_end(pattern)
    if msg is None:
        msg = _probe(rules, top)
        with _lock:
            _kept[pattern] = msg
            while len(_kept) > MAX_KEPT:
                _kept.popitem(last=False)
    if msg:
        shown = pattern if len(pattern) <= _SHOWN else pattern[:_SHOWN] + "..."
        raise GrammarError(f"{msg} (JSON schema pattern {shown})")


def _probe(rules: dict[str, str], top: str) -> str:
    text = "".join(f"{name} ::= {body}\n" for name, body in rules.items())
    if top != "root":
        text = f"root ::= {top}\n" + text
    try:
        with probing_turn():
            parsed = parse_gbnf(text)
            m = Matcher(parsed)
            with m.session(probing=True):
                m.probe(parsed.repeats)
    except WorkCancelled:
        raise
    except GrammarError as e:
        return str(e)
    return ""
