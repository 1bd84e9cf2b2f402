"""GBNF grammar-constrained decoding (llama.cpp's --grammar, --json-schema, `grammar` requests).

`compile_grammar` parses once (GrammarError on bad text); a `Grammar` is immutable to its users
and may be shared by several generations, each of which follows it with its own
`GrammarSampler` (engine/grammar/sampler.py). parse.py reads GBNF, match.py is the pushdown
matcher over code points, tokens.py the vocabulary as a trie, budget.py the limits that keep a
hostile grammar from stalling the process. `GrammarCache` keeps compiled grammars by text,
bounded by their estimated size.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ubatch.engine.grammar.budget import ENTRY_BYTES, probing_turn
from ubatch.engine.grammar.elements import GrammarError
from ubatch.engine.grammar.match import Matcher
from ubatch.engine.grammar.parse import parse_gbnf

__all__ = ["Grammar", "GrammarCache", "GrammarError", "compile_grammar", "JSON_GBNF"]

# What a GrammarCache keeps by default, estimated: a JSON schema's grammar is some thousands of
# elements (~130 bytes each, with the states its matcher reaches); a 20,000-item anyOf is some
# 60 MiB, kept; anything larger is compiled per request. Matcher states are bounded apart too.
MAX_CACHE_BYTES = 128 << 20


@dataclass(eq=False)
class Grammar:
    """A compiled grammar: its text (reported back as llama-server does) and its matcher, whose
    interned states and transitions fill in as generations use them."""

    text: str
    matcher: Matcher = field(repr=False)
    # A lazy grammar (llama.cpp's grammar_lazy): the text is free until one of these appears,
    # then constrained from where it starts. Words match anywhere; patterns are regexes searched
    # from the text's start, the constrained part starting at group 1 (or the match).
    trigger_words: tuple[str, ...] = ()
    trigger_patterns: tuple[str, ...] = ()

    @property
    def lazy(self) -> bool:
        return bool(self.trigger_words or self.trigger_patterns)

    def with_triggers(self, words: tuple[str, ...] = (), patterns: tuple[str, ...] = ()) -> Grammar:
        """The same grammar (its matcher shared), lazy: engaged by `words` or `patterns`."""
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise GrammarError(f"invalid grammar trigger pattern {p!r}: {e}") from None
        return Grammar(self.text, self.matcher, tuple(words), tuple(patterns))

    def accepts(self, text: str) -> bool:
        """Is `text` a complete match? (for tests and checks; generation works per token)"""
        m = self.matcher
        with m.session():
            sid = m.walk(m.start, text)
            return sid >= 0 and m.info(sid).accepting

    def size_estimate(self) -> int:
        """Bytes held, roughly: the text, the rules' elements and the matcher's interned states."""
        return len(self.text) + ENTRY_BYTES * (len(self.matcher.elems) + self.matcher.entries)


def compile_grammar(text: str, tokenize: Callable[[str], list[int]] | None = None, *, probe: bool = False) -> Grammar:
    """GBNF text -> Grammar, starting at rule `root`. `tokenize` resolves `<text>` token
    references; GrammarError names the problem and its line and column. `probe` also walks
    the first characters, and from each repetition of an item that can match nothing
    (Matcher.probe), so that a grammar too ambiguous to match is refused
    here rather than by the generation that meets it: what a server wants for a request's (one
    probing compile at a time: budget.py `probing_turn`)."""
    if not probe:
        return Grammar(text, Matcher(parse_gbnf(text, tokenize)))
    with probing_turn():
        parsed = parse_gbnf(text, tokenize)
        grammar = Grammar(text, Matcher(parsed))
        with grammar.matcher.session(probing=True):
            grammar.matcher.probe(parsed.ambiguous)
    return grammar


class GrammarCache:
    """Compiled grammars by text, least recently used dropped first once their estimated size
    passes `max_bytes` (a count would let 32 huge grammars in as easily as 32 small ones); a
    grammar larger than the whole budget is compiled and returned but not kept. Grammars are
    compiled with `probe` (a server's request grammars: refused before they run)."""

    def __init__(self, max_bytes: int = MAX_CACHE_BYTES, probe: bool = True) -> None:
        self.max_bytes, self.probe = max_bytes, probe
        self._items: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> Grammar:
        """The compiled grammar for `text` (GrammarError, not cached, if it does not compile)."""
        with self._lock:
            hit = self._items.get(text)
            if hit is not None:
                self._items.move_to_end(text)
                return hit
        grammar = compile_grammar(text, probe=self.probe)
        if grammar.size_estimate() > self.max_bytes:
            return grammar
        with self._lock:
            self._items[text] = grammar
            self._items.move_to_end(text)
            self._trim()
        return grammar

    def size_estimate(self) -> int:
        """The bytes the kept grammars hold, estimated (what `max_bytes` bounds)."""
        with self._lock:
            return sum(g.size_estimate() for g in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def _trim(self) -> None:
        total = sum(g.size_estimate() for g in self._items.values())
        while self._items and total > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            total -= dropped.size_estimate()


# A JSON object of any shape: what the json_object response format allows when no schema is given.
JSON_GBNF = r"""
root    ::= object
value   ::= object | array | string | number | ("true" | "false" | "null") ws
object  ::= "{" ws ( member ( "," ws member )* )? "}" ws
member  ::= string ":" ws value
array   ::= "[" ws ( value ( "," ws value )* )? "]" ws
string  ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\"" ws
number  ::= "-"? ( "0" | [1-9] [0-9]{0,15} ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )? ws
ws      ::= | " " | "\n" [ \t]{0,20}
"""
