"""GBNF grammars without a model: the parser (llama.cpp's syntax and its errors), the matcher
(which strings a grammar accepts), and the token level on the tiny vocabulary (the allowed
candidates equal a brute-force check of every token, byte tokens splitting UTF-8 included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ubatch.engine.errors import UbatchError
from ubatch.engine.grammar import JSON_GBNF, GrammarError, compile_grammar
from ubatch.engine.grammar.sampler import GrammarSampler, window
from ubatch.engine.grammar.utf8 import decode_utf8
from ubatch.engine.sampling.chain import SamplerParams

ACCEPTS = [  # grammar, text, accepted
    ('root ::= "yes" | "no"', "yes", True),
    ('root ::= "yes" | "no"', "no", True),
    ('root ::= "yes" | "no"', "ye", False),
    ('root ::= "yes" | "no"', "yesno", False),
    ('root ::= "a"{2,3}', "a", False),
    ('root ::= "a"{2,3}', "aa", True),
    ('root ::= "a"{2,3}', "aaa", True),
    ('root ::= "a"{2,3}', "aaaa", False),
    ('root ::= "a"{2}', "aa", True),
    ('root ::= "a"{2,} "b"', "aaaaab", True),
    ('root ::= "a"{2,} "b"', "ab", False),
    ('root ::= "a"{0} "b"', "b", True),
    ('root ::= ("ab" | "c")+ "."?', "abcab.", True),
    ('root ::= ("ab" | "c")+ "."?', "", False),
    ('root ::= ("ab" | "c")* "."?', "", True),
    ("root ::= [a-c0-9]+", "ab09c", True),
    ("root ::= [a-c0-9]+", "abd", False),
    ('root ::= [^"\\\\]+', "plain text", True),
    ('root ::= [^"\\\\]+', 'with "quote', False),
    ("root ::= . .", "é✓", True),
    ("root ::= . .", "abc", False),
    ('root ::= "\\x41\\u00e9\\U0001F600\\n\\t\\"\\\\"', 'Aé😀\n\t"\\', True),
    ("root ::= [\\u00e0-\\u00ff]", "é", True),
    ("root ::= [\\u00e0-\\u00ff]", "e", False),
    ("root ::= [\\]\\-]+", "]-]", True),
    ('# a comment\nroot ::= item+ # trailing\nitem ::= ( "x"\n  | "y" )\n', "xyx", True),
    ('root ::= a b\na ::= "1"\nb ::= "2" | ""', "1", True),
    ("root ::= [a-z]\n", "q", True),
    ("root ::= []", "", True),  # an empty class adds nothing (llama.cpp's parse)
]


@pytest.mark.parametrize("gbnf,text,ok", ACCEPTS)
def test_matcher_accepts_what_the_grammar_describes(gbnf: str, text: str, ok: bool) -> None:
    assert compile_grammar(gbnf).accepts(text) is ok


@pytest.mark.parametrize(
    "text,ok",
    [
        ('{"a": [1, -2.5e3, true, null, "x\\n\\u00e9"], "b": {"c": {}}}', True),
        ("{}", True),
        ('{"a": 1}\n', True),
        ('{"a" 1}', False),
        ('{"a": 01}', False),
        ("[1]", False),  # the generic grammar is an object, as json_object asks
        ('{"a": "tab\there"}', False),
    ],
)
def test_json_grammar(text: str, ok: bool) -> None:
    assert compile_grammar(JSON_GBNF).accepts(text) is ok


ERRORS = [  # grammar, words the message must hold
    ("root ::= this is (not valid GBNF", "expecting ')' at line 1, column 33"),
    ("root ::= foo", "undefined rule 'foo'"),
    ('foo ::= "a"', "does not contain a 'root' rule"),
    ('root ::= "abc', "unexpected end of input"),
    ("root ::= [a-", "unexpected end of input"),
    ('root ::= "\\q"', "unknown escape at line 1, column 11"),
    ('root ::= "\\x4"', "expecting 2 hex chars"),
    ('root := "a"', "expecting ::= at line 1, column 6"),
    ('root ::= * "a"', "expecting preceding item to */+/?/{ at line 1, column 10"),
    ('root ::= "a"{1,x}', "expecting '}'"),
    ('root ::= "a"{x}', "expecting an int"),
    ('root ::= "a"{1;2}', "expecting ','"),
    ('root ::= "a"{2001}', "more than 2000 repetitions"),
    ('root ::= root "a" | "b"', "left recursion in rule 'root'"),
    ('root ::= x\nx ::= ("" | "c") x "a"', "left recursion in rule 'x'"),
    ('root ::= "a"\n| "b"', "expecting name at line 2, column 1"),
    ('root ::= "a" )', "expecting newline or end at line 1, column 14"),
    ("", "no rules"),
    ("root ::= <[12", "expecting ']'"),
    ("root ::= <hello>", "no vocabulary to resolve the token"),
]


@pytest.mark.parametrize("gbnf,needle", ERRORS)
def test_bad_grammars_are_one_line_errors(gbnf: str, needle: str) -> None:
    with pytest.raises(GrammarError) as e:
        compile_grammar(gbnf)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg
    assert isinstance(e.value, UbatchError)


def test_a_long_chain_of_repetitions_compiles() -> None:
    """{m,n} expands into n-m nested rules, checked for left recursion without recursing."""
    compile_grammar('root ::= ("a" | ""){0,1500} "b"')  # deeper than Python's recursion limit
    g = compile_grammar('root ::= ("a" | ""){0,20} "b"')
    assert g.accepts("aaab") and not g.accepts("aaa") and not g.accepts("a" * 21 + "b")


def test_decode_utf8_carries_a_split_character() -> None:
    assert decode_utf8("é".encode()) == ([0xE9], 0xE9, 0)
    cps, value, n_remain = decode_utf8(b"a\xe2\x9c")  # ✓ is e2 9c 93
    assert cps == [ord("a")] and n_remain == 1
    assert decode_utf8(b"\x93b", value, n_remain)[0] == [ord("✓"), ord("b")]
    assert decode_utf8(b"\x93")[2] == -1  # a continuation byte cannot start a character
    assert decode_utf8(b"ab\x00cd")[0] == [97, 98]  # llama.cpp stops at NUL


def test_window_is_what_the_chain_reads() -> None:
    assert window(SamplerParams(temp=0)) == 1
    assert window(SamplerParams()) == 40
    assert window(SamplerParams(top_k=0)) is None  # top-p over every candidate
    assert window(SamplerParams(temp=0, top_k=0)) == 1  # top-p and min-p keep the best
    assert window(SamplerParams(mirostat=2)) is None
    assert window(SamplerParams(temp=0, typ_p=0.5, top_k=0)) is None


# -- the token level, on the tiny vocabulary -----------------------------------------------------

TOKEN_GRAMMARS = [
    'root ::= "yes" | "no"',
    'root ::= "é✓" [a-z]+ "."',  # only byte tokens can spell é and ✓ in the tiny vocabulary
    "root ::= [^é]{1,4}",
    'root ::= "hello" " world"?',
    'root ::= "a" <[300]> "b"',  # a token reference, by id
]


def _brute(gs: GrammarSampler, x: torch.Tensor) -> list[int]:
    """Every allowed token with a finite logit, best first (stable: lower id first on ties)."""
    order = np.argsort(-x.numpy(), kind="stable")
    return [int(t) for t in order if x[t] > float("-inf") and gs.allows(int(t))]


@pytest.mark.parametrize("gbnf", TOKEN_GRAMMARS)
def test_allowed_candidates_equal_a_check_of_every_token(gbnf: str, tiny_gemma_model) -> None:  # type: ignore[no-untyped-def]
    """Along random walks through the grammar, with some logits at -inf: the candidates are
    allowed tokens and hold the k best of a check of every token (all of them for k=None)."""
    vocab = tiny_gemma_model.vocab
    g = compile_grammar(gbnf)
    rng = np.random.default_rng(7)
    for _walk in range(6):
        gs = GrammarSampler(g, vocab)
        for _step in range(12):
            x = torch.from_numpy(rng.standard_normal(vocab.n_tokens).astype(np.float32))
            x[rng.integers(0, vocab.n_tokens, 20)] = float("-inf")
            brute = _brute(gs, x)
            for k in (1, 5, None):  # every candidate allowed, the k best among them
                got = set(gs.candidates(x, k, False))
                assert got <= set(brute) and set(brute if k is None else brute[:k]) <= got, (gbnf, k)
            if not brute:
                break
            tok = brute[int(rng.integers(0, len(brute)))]
            if tok in vocab.eog:
                assert gs.accepting
                break
            gs.accept(tok)


def test_a_split_character_allows_only_its_continuation(tiny_gemma_model) -> None:  # type: ignore[no-untyped-def]
    vocab = tiny_gemma_model.vocab
    byte = {vocab.token_to_piece(i, special=True): i for i in range(vocab.n_tokens)}
    gs = GrammarSampler(compile_grammar('root ::= "é" "!"'), vocab)
    assert gs.allows(byte[b"\xc3"]) and not gs.allows(byte[b"\xc2"]) and not gs.allows(byte[b"e"])
    gs.accept(byte[b"\xc3"])
    x = torch.zeros(vocab.n_tokens)
    assert gs.candidates(x, None, False) == [byte[b"\xa9"]]
    gs.accept(byte[b"\xa9"])
    bang = {i for i in range(vocab.n_tokens) if vocab.token_to_piece(i) == b"!"}  # "!" and <0x21>
    assert set(gs.candidates(x, None, False)) == bang and len(bang) == 2 and not gs.accepting
    gs.accept(min(bang))
    assert gs.accepting and gs.candidates(x, None, False) == sorted(vocab.eog)
