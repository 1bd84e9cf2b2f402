"""BPE pre-tokenisation as llama.cpp runs it (unicode_regex_split): words from a chain of regexes.

llama.cpp runs a regex that names Unicode categories on a "collapsed" copy of the text, where
every non-ASCII code point is one byte naming its category, and \\p{L} becomes that byte plus
A-Za-z; a regex without categories runs on the code points with non-ASCII whitespace turned into
0x0B. Its hand-written splitters for the GPT-2, Llama 3, Qwen 2 and Qwen 3.5 regexes give what
those regexes give. So Python's `re` (backtracking, leftmost alternative first, as ECMAScript)
on the same collapsed or widened text, with ASCII-only \\s and \\d as in the C locale, splits
exactly where llama.cpp does, at C speed.
"""

from __future__ import annotations

import re
import re._parser as re_parser  # type: ignore[import-not-found]  # typeshed lacks it; 3.11+ has it
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ubatch.engine.vocab import unicode
from ubatch.engine.vocab.pre_regexes import RAW_UTF8, REGEXES


@dataclass(frozen=True)
class PreTokenizer:
    """What one tokenizer.ggml.pre name sets in llama.cpp (llama_vocab::impl::load)."""

    type: str  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_* name
    ignore_merges: bool = False
    clean_spaces: bool = True
    add_bos: bool = False
    add_sep: bool = False
    escape_whitespaces: bool = False
    no_bos: bool = False  # special_bos_id = LLAMA_TOKEN_NULL
    lowercase: bool | None = None  # the normaliser's default, where the name sets one

    @property
    def byte_encode(self) -> bool:
        return self.type not in RAW_UTF8


def _names(names: str, type: str, **kw: bool) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), PreTokenizer(type, **kw))


_KEEP = {"clean_spaces": False}
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_names("default", "DEFAULT"),
    **_names("minicpm5", "MINICPM5", ignore_merges=True),
    **_names(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        "LLAMA3",
        ignore_merges=True,
        add_bos=True,
    ),
    **_names("deepseek-llm", "DEEPSEEK_LLM", **_KEEP),
    **_names("deepseek-coder", "DEEPSEEK_CODER", **_KEEP),
    **_names("deepseek-v3", "DEEPSEEK3_LLM", **_KEEP),
    **_names("spark2_5", "SPARK2_5", **_KEEP),
    **_names("youtu", "YOUTU", ignore_merges=True, **_KEEP),
    **_names("falcon", "FALCON"),
    **_names("mpt", "MPT"),
    **_names("starcoder", "STARCODER"),
    **_names("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4", "GPT2"),
    **_names("jais-2", "JAIS2"),
    **_names("gemma4 granite-embed-multi-311m", "GEMMA4", escape_whitespaces=True),
    **_names("mmbert", "MMBERT", escape_whitespaces=True),
    **_names("sarvam-moe", "SARVAM_MOE", escape_whitespaces=True, **_KEEP),
    **_names("jina-v1-en jina-v2-code roberta-bpe", "GPT2", add_sep=True),
    **_names("whitespace", "WHITESPACE", lowercase=False),
    **_names("refact", "REFACT"),
    **_names("command-r", "COMMAND_R", **_KEEP),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2", "QWEN2", **_KEEP),
    **_names("qwen35", "QWEN35", **_KEEP),
    **_names("stablelm2", "STABLELM2"),
    **_names("olmo", "OLMO"),
    **_names("dbrx", "DBRX"),
    **_names("smaug-bpe", "SMAUG"),
    **_names("poro-chat", "PORO", **_KEEP),
    **_names("chatglm-bpe", "CHATGLM4", no_bos=True),
    **_names("glm4 glm5", "CHATGLM4", no_bos=True, ignore_merges=True),
    **_names("viking", "VIKING", **_KEEP),
    **_names("jais", "JAIS"),
    **_names("tekken", "TEKKEN", ignore_merges=True, add_bos=True, **_KEEP),
    **_names("smollm", "SMOLLM", **_KEEP),
    **_names("codeshell", "CODESHELL"),
    **_names("bloom", "BLOOM"),
    **_names("gpt3-finnish", "GPT3_FINNISH"),
    **_names("exaone", "EXAONE"),
    **_names("exaone-moe", "EXAONE_MOE"),
    **_names("chameleon", "CHAMELEON", add_bos=True, **_KEEP),
    **_names("minerva-7b", "MINERVA"),
    **_names("megrez", "QWEN2"),
    **_names("gpt-4o llama4 kanana2 talkie", "GPT4O", **_KEEP),
    **_names("granite-embed-multi-97m", "GRANITE_EMB_MULTI", ignore_merges=True, **_KEEP),
    **_names("tiny_aya cohere2moe", "TINY_AYA", **_KEEP),
    **_names("superbpe", "SUPERBPE", **_KEEP),
    **_names("trillion", "TRILLION", **_KEEP),
    **_names("granite-docling", "GRANITE_DOCLING", **_KEEP),
    **_names("bailingmoe bailingmoe2 llada-moe", "BAILINGMOE", **_KEEP),
    **_names("seed-coder", "SEED_CODER", **_KEEP),
    **_names("hunyuan", "HUNYUAN", **_KEEP),
    **_names("hunyuan-dense", "HUNYUAN_DENSE", **_KEEP),
    **_names("hy_v4", "HY_V4", **_KEEP),
    **_names("joyai-llm", "JOYAI_LLM", **_KEEP),
    **_names("kimi-k2", "KIMI_K2", **_KEEP),
    **_names("ufakzeka", "UFAKZEKA", **_KEEP),
    **_names("grok-2", "GROK_2", **_KEEP),
    **_names("afmoe", "AFMOE", **_KEEP),
    **_names("laguna", "LAGUNA", **_KEEP),
    **_names("minimax-m2", "MINIMAX_M2", **_KEEP),
    **_names("solar-open", "SOLAR_OPEN", **_KEEP),
    **_names("mellum2", "MELLUM2"),
}
UNSUPPORTED_PRE: dict[str, str] = {}  # pre-tokeniser types that are refused, with why

# \p{...} -> the collapsed byte of its category plus the ASCII members (llama.cpp's k_ucat_map)
_N, _L, _P, _M, _S = (chr(unicode.COLLAPSED[f]) for f in (unicode.NUMBER, unicode.LETTER, unicode.PUNCTUATION,
                                                          unicode.ACCENT_MARK, unicode.SYMBOL))  # fmt: skip
_CATEGORY_CLASS = {
    "\\p{N}": _N + "0-9",
    "\\p{L}": _L + "A-Za-z",
    "\\p{P}": _P + "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    "\\p{M}": _M,
    "\\p{S}": _S + "\\$\\+<->\\^`\\|~",
}
for _sub in ("Lu", "Ll", "Lt", "Lm", "Lo"):
    _CATEGORY_CLASS[f"\\p{{{_sub}}}"] = _CATEGORY_CLASS["\\p{L}"]
# llama.cpp's own splitters for regexes std::regex cannot run (digit grouping from the right)
_DIGIT_GROUPS = ("\\p{AFMoE_digits}", "\\d{1,3}(?=(?:\\d{3})*\\b)")


def _collapsed_regex(expr: str) -> str:
    """llama.cpp's rewrite of a regex for the collapsed text (tracking [...] as it does)."""
    out, inside, i = [], False, 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
        elif inside and c == "]" and expr[i - 1] != "\\":
            inside = False
        elif expr.startswith("\\p{", i) and 0 < (close := expr.find("}", i + 3)) <= i + 10:
            cls = _CATEGORY_CLASS.get(expr[i : close + 1])
            if cls is not None:
                out.append(cls if inside else f"[{cls}]")
                i = close + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _ecmascript(expr: str) -> str:
    """ECMAScript -> Python re: `$` is the end of the piece only (Python's also matches before a
    final newline)."""
    out, inside, i = [], False, 0
    while i < len(expr):
        c = expr[i]
        if c == "\\":
            out.append(expr[i : i + 2])
            i += 2
            continue
        inside = (inside or c == "[") and not (inside and c == "]")
        out.append("\\Z" if c == "$" and not inside else c)
        i += 1
    return "".join(out)


_TRAILING_SPACE, _ASCII_SPACE = "(\\s+\\Z)", " \t\n\r\f\v"  # deepseek-llm's "\\s+$", as compiled
_SEP = "\0"  # joins the words of a text when a step's regex can never consume it (see _Step.split)
_POSITIVE_CATEGORIES = {"CATEGORY_SPACE", "CATEGORY_DIGIT", "CATEGORY_WORD"}  # ASCII: none holds NUL


def _cannot_cross(items: list[tuple[Any, Any]]) -> bool:
    """The parsed regex (re._parser) looks at nothing but what it consumes (no anchors, no
    lookaround, no backreferences) and can consume no NUL: positive classes and literals only."""
    for op, av in items:
        name = str(op)
        if name == "LITERAL":
            ok = av != 0
        elif name == "IN":
            ok = all(
                (str(k) == "LITERAL" and v != 0)
                or (str(k) == "RANGE" and v[0] > 0)
                or (str(k) == "CATEGORY" and str(v) in _POSITIVE_CATEGORIES)
                for k, v in av
            )
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            ok = _cannot_cross(av[2])
        elif name == "SUBPATTERN":
            ok = _cannot_cross(av[3])
        elif name == "BRANCH":
            ok = all(_cannot_cross(b) for b in av[1])
        else:  # AT, ASSERT, ASSERT_NOT, ANY, NOT_LITERAL, GROUPREF, ...
            ok = False
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class _Step:
    pattern: re.Pattern[str] | None  # the regex as one capturing group (for re.split); None: digit groups
    view: str  # which copy of the text it reads: "collapsed", "wide" or "han" (_VIEWS)
    joinable: bool = False  # its matches never cross a NUL and see nothing beyond themselves

    def split(self, pieces: list[str]) -> list[str]:
        """Each piece cut on its own. A regex that only sees what it consumes and never consumes
        NUL finds the same matches in the pieces joined with NUL as in each apart: one C call."""
        if len(pieces) == 1:
            return self.pieces(pieces[0])
        if self.pattern is not None and self.pattern.pattern == _TRAILING_SPACE:  # \s+$: each piece's tail
            return [w for p in pieces for w in (p.rstrip(_ASCII_SPACE), p[len(p.rstrip(_ASCII_SPACE)) :]) if w]
        if self.joinable and self.pattern is not None and self.pattern.groups == 1:
            joined = _SEP.join(pieces)
            if joined.count(_SEP) == len(pieces) - 1:  # no NUL of the text's own
                return [w for w in _SEP.join(self.pattern.split(joined)).split(_SEP) if w]
        return [w for p in pieces for w in (self.pieces(p) if len(p) > 1 else (p,))]  # one character is one word

    def pieces(self, s: str) -> list[str]:
        """`s` cut at the matches, the text between matches kept: [gap, match, gap, ...] less the
        empty ones, in C (re.split) rather than a Python loop over matches."""
        if self.pattern is None:
            return _digit_groups(s)
        parts = self.pattern.split(s)
        k = self.pattern.groups + 1
        if k > 2:  # drop the regex's own groups, which re.split returns after each match
            parts = [p for i, p in enumerate(parts) if i % k < 2]
        return [p for p in parts if p]


def _step(expr: str) -> _Step:
    if expr in _DIGIT_GROUPS:
        return _Step(None, "collapsed")
    if expr == "\\p{Han}+":  # Kimi K2: llama.cpp's own splitter, which is this regex over Han-marked text
        return _Step(re.compile(f"({_KIMI_K2})", re.ASCII), "han")
    collapsed = any(cat in expr for cat in _CATEGORY_CLASS)
    if collapsed and not expr.isascii():
        raise ValueError(f"regex mixes Unicode categories and non-ASCII characters: {expr!r}")
    src = _ecmascript(_collapsed_regex(expr) if collapsed else expr)
    joinable = _cannot_cross(list(re_parser.parse(src, re.ASCII)))
    return _Step(re.compile(f"({src})", re.ASCII), "collapsed" if collapsed else "wide", joinable)


# unicode_regex_split_custom_kimi_k2, on text where Han letters are 0xD6 and the unassigned code
# points of the Han blocks 0xD7 (Han by range, but no letters: they may follow other symbols)
_KL, _KN, _KH = _CATEGORY_CLASS["\\p{L}"], _CATEGORY_CLASS["\\p{N}"], "\xd6"
_KIMI_K2 = (
    f"[{_KH}\xd7]+"
    f"|[^\\r\\n{_KL}{_KN}{_KH}]?[{_KL}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    f"|[{_KN}]{{1,3}}| ?[^\\s{_KL}{_KN}{_KH}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_VIEWS = {"collapsed": unicode.collapse, "wide": unicode.wide_text, "han": unicode.collapse_han}


class Splitter:
    """One pre-tokeniser: text -> words. Each regex after the first runs on each word of the one
    before, as a text of its own (its end is the end for lookaheads, as in std::regex_iterator)."""

    def __init__(self, pre_type: str) -> None:
        self.steps = [_step(e) for e in REGEXES.get(pre_type, REGEXES["DEFAULT"])]

    def words(self, text: str) -> list[str]:
        if not text:
            return []
        views = {v: _VIEWS[v](text) for v in {s.view for s in self.steps}}
        pieces, view = [text], text
        for step in self.steps:
            s = views[step.view]
            if s is not view:  # the previous step cut another view of the text: cut this one alike
                pieces, view = cut_like(s, pieces), s
            pieces = step.split(pieces)
        return pieces if view is text else cut_like(text, pieces)


def cut(s: str, lengths: Iterable[int]) -> list[str]:
    """`s` cut into parts of these lengths: NUL put between them with numpy and one str.split
    (a slice per word costs more once a text has 300k words)."""
    ends = np.cumsum(np.fromiter(lengths, np.int64))
    if _SEP in s:
        return [s[a:b] for a, b in zip([0, *ends[:-1].tolist()], ends.tolist())]
    joined = np.insert(unicode.codepoints(s), ends[:-1], 0).astype("<u4").tobytes()
    return joined.decode("utf-32-le", "surrogatepass").split(_SEP)


def cut_like(s: str, pieces: list[str]) -> list[str]:
    """`s` cut as `pieces` (non-empty, of another view of it) cut theirs: the pieces joined with
    NUL, and s's code points put where theirs are, with numpy (no length of each piece)."""
    if _SEP in s:
        return cut(s, map(len, pieces))
    view = np.frombuffer(_SEP.join(pieces).encode("utf-32-le", "surrogatepass"), np.uint32).copy()
    view[view != 0] = unicode.codepoints(s)
    return view.tobytes().decode("utf-32-le", "surrogatepass").split(_SEP)


_DIGITS = re.compile(f"[{_N}0-9]+")


def _digit_groups(s: str) -> list[str]:
    """llama.cpp's unicode_regex_split_custom_afmoe: a digit run splits into a leading 1-2 digits
    (its length mod 3) and groups of 3; the text before a run joins its first group."""
    out: list[str] = []
    prev = 0
    for m in _DIGITS.finditer(s):
        x, y = m.span()
        first = x + ((y - x) % 3 or 3)
        out.append(s[prev:first])
        out.extend(s[k : k + 3] for k in range(first, y, 3))
        prev = y
    if prev < len(s):
        out.append(s[prev:])
    return out
