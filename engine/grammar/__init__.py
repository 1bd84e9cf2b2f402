"""GBNF grammar-constrained decoding (llama.cpp's --grammar, --json-schema, `grammar` requests).

`compile_grammar` parses once (GrammarError on bad text); a `Grammar` is immutable to its users
and may be shared by several generations, each of which follows it with its own
`GrammarSampler` (engine/grammar/sampler.py). parse.py reads GBNF, match.py is the pushdown
matcher over code points, tokens.py the vocabulary as a trie.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ubatch.engine.grammar.elements import GrammarError
from ubatch.engine.grammar.match import Matcher
from ubatch.engine.grammar.parse import parse_gbnf

__all__ = ["Grammar", "GrammarError", "compile_grammar", "JSON_GBNF"]


@dataclass(eq=False)
class Grammar:
    """A compiled grammar: its text (reported back as llama-server does) and its matcher, whose
    interned states and transitions fill in as generations use them."""

    text: str
    matcher: Matcher = field(repr=False)

    def accepts(self, text: str) -> bool:
        """Is `text` a complete match? (for tests and checks; generation works per token)"""
        m = self.matcher
        sid = m.walk(m.start, text)
        return sid >= 0 and m.info(sid).accepting


def compile_grammar(text: str, tokenize: Callable[[str], list[int]] | None = None) -> Grammar:
    """GBNF text -> Grammar, starting at rule `root`. `tokenize` resolves `<text>` token
    references; GrammarError names the problem and its line and column."""
    return Grammar(text, Matcher(parse_gbnf(text, tokenize)))


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
