"""The budget a chat template renders under: Jinja's immutable sandbox keeps a template from
touching anything but its variables, not from spending the process's time and memory
(`{% for i in range(100000) %}{% for j in range(100000) %}`, `'A' * 4000000000`,
`tojson(indent=2000000000)`). A template comes from a GGUF file or a --chat-template, so it is
untrusted input, rendered on every request.

Each render gets a `RenderBudget`: steps (loop iterations, calls, filters, operators, lookups),
a deadline, and sizes: one value, the output, all strings built together. The sandbox hooks
count and check at every place a template can spend: operators (`intercepted_binops`), calls
(string methods with a width or a count are checked before they run), filters (wrapped),
`str.format`, `~` and captured output (the code generator routes them through checks), and
every `for` loop (its iterable is counted item by item). A template past a limit stops with a
`TemplateBudgetError`: a ChatTemplateError, one line naming the template and the limit.

Imported on first render only (it imports jinja2), from jinja_env.py.
"""

from __future__ import annotations

import re
import string
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import ChainableUndefined, Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

from ubatch.engine.chat.errors import ChatTemplateError

if TYPE_CHECKING:
    from jinja2.runtime import Undefined

# Steps one render may take: loop iterations, calls, filters, operators and lookups. Real
# templates take a few dozen per message (a 1,000-message conversation with tools: ~100,000).
MAX_RENDER_STEPS = 2_000_000
# Wall time one render may take, checked every few steps: a real template renders in
# milliseconds; this catches single steps that are slow (big strings) rather than many.
MAX_RENDER_SECONDS = 2.0
# The largest string or list one operation may build: this many characters plus twice what the
# messages hold (a template copies a message's text, it does not multiply it).
BASE_VALUE_CHARS = 4 << 20
OUTPUT_FACTOR = 4  # the rendered prompt: at most this many values' worth
ALLOC_FACTOR = 64  # all strings and lists built in one render, together
MAX_JSON_INDENT = 64  # tojson(indent=...): real templates use 2 or 4
MAX_INT_BITS = 1 << 16  # integers built by `*` and `**` (a 65,536-bit number is ~20,000 digits)
_CHECK_EVERY = 256  # steps between looks at the clock

_ITER_FILTER = "ubatch_counted"  # the filter every `for` loop's iterable goes through
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")
_DIGITS = re.compile(r"\d+")
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})


class TemplateBudgetError(ChatTemplateError):
    """A template that went past one of its render's limits (one line, names the limit)."""


@dataclass(slots=True)
class RenderBudget:
    """One render's limits and what it has spent of them."""

    what: str  # the template, as the error names it
    value_chars: int
    deadline: float
    steps: int = 0
    allocated: int = 0

    @classmethod
    def for_input(cls, what: str, input_chars: int) -> RenderBudget:
        return cls(what, BASE_VALUE_CHARS + 2 * input_chars, time.monotonic() + MAX_RENDER_SECONDS)

    @property
    def output_chars(self) -> int:
        return OUTPUT_FACTOR * self.value_chars

    @property
    def alloc_chars(self) -> int:
        return ALLOC_FACTOR * self.value_chars

    def fail(self, why: str) -> TemplateBudgetError:
        return TemplateBudgetError(f"{self.what}: rendering stopped: {why}")

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_RENDER_STEPS:
            raise self.fail(f"more than {MAX_RENDER_STEPS:,} steps (loop iterations, calls, lookups) in one render")
        if not self.steps % _CHECK_EVERY and time.monotonic() > self.deadline:
            raise self.fail(f"longer than {MAX_RENDER_SECONDS:g} s for one render")

    def size(self, n: int, what: str = "a value") -> None:
        """Refuse to build a value of `n` characters or items (checked before building it)."""
        if n > self.value_chars:
            raise self.fail(f"{what} of {n:,} characters or items is past the limit of {self.value_chars:,}")

    def built(self, n: int) -> None:
        """Count `n` characters or items built (all strings built together are bounded)."""
        self.allocated += n
        if self.allocated > self.alloc_chars:
            raise self.fail(f"more than {self.alloc_chars:,} characters of strings built in one render")

    def result(self, value: object) -> object:
        """Check and count a value an operation built (its inputs were checked: at most a few
        times the limit)."""
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
            raise self.fail(f"a number of more than {MAX_INT_BITS:,} bits")
        if isinstance(value, (str, list, tuple, dict, set, frozenset)):
            self.size(len(value))
            self.built(len(value))
        return value


_CURRENT: ContextVar[RenderBudget | None] = ContextVar("ubatch_render_budget", default=None)


def _budget() -> RenderBudget:
    """The render in progress' budget; outside `render` (a direct Template.render), a fresh one
    each time: sizes are still checked, steps and time are not."""
    b = _CURRENT.get()
    return b if b is not None else RenderBudget.for_input("chat template", 0)


def render(template: jinja2.Template, what: str, input_chars: int, variables: dict[str, object]) -> str:
    """Render under a fresh budget sized for `input_chars` of message text; TemplateBudgetError
    past a limit. Other template errors propagate as Jinja raises them."""
    b = RenderBudget.for_input(what, input_chars)
    token = _CURRENT.set(b)
    try:
        out: list[str] = []
        n = 0
        for chunk in template.generate(variables):
            n += len(chunk)
            if n > b.output_chars:
                raise b.fail(f"the prompt passed {b.output_chars:,} characters")
            out.append(chunk)
        return "".join(out)
    finally:
        _CURRENT.reset(token)


# -- checks before an operation builds its result ---------------------------------------------


def _length(x: object) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple)) else None


def _check_binop(b: RenderBudget, op: str, left: object, right: object) -> None:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            size = _length(seq)
            if size is not None and isinstance(n, int):
                b.size(size * n, "a repeated string or list")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise b.fail(f"a number of more than {MAX_INT_BITS:,} bits")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if right * left.bit_length() > MAX_INT_BITS:
                raise b.fail(f"a number of more than {MAX_INT_BITS:,} bits")
    elif op == "%" and isinstance(left, str):
        _check_printf(b, left, right if isinstance(right, tuple) else (right,))


def _check_printf(b: RenderBudget, fmt: str, args: Iterable[object]) -> None:
    """`'%9999999s' % x` pads to its width: refuse widths and precisions past the limit."""
    star = False
    for m in _PRINTF.finditer(fmt):
        for spec in m.groups():
            if spec == "*":
                star = True
            elif spec:
                b.size(int(spec), "a printf width")
    if star:
        for a in args:
            if isinstance(a, int):
                b.size(a, "a printf width")


def _check_format(b: RenderBudget, fmt: str, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """`'{:>9999999}'.format(x)` likewise; a width taken from an argument (`{:{}}`) is checked
    among the arguments."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # malformed: str.format raises its own error
    for _, _, spec, _ in fields:
        if not spec:
            continue
        if "{" in spec:
            for a in (*args, *kwargs.values()):
                if isinstance(a, int):
                    b.size(a, "a format width")
        for digits in _DIGITS.findall(spec):
            b.size(int(digits), "a format width")


def _check_str_method(b: RenderBudget, s: str, name: str, args: tuple[object, ...]) -> tuple[object, ...]:
    """The string methods whose result can outgrow their inputs; returns the arguments to call
    with (a generator given to join is read once, here)."""
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        b.size(args[0], f"str.{name} width")
    elif name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else 8
        b.size(len(s) + s.count("\t") * tab, "str.expandtabs result")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_replace(b, s, args[0], args[1])
    elif name == "join" and args and isinstance(args[0], Iterable):
        items = list(args[0])
        b.size(sum(len(x) for x in items if isinstance(x, str)) + len(s) * len(items), "str.join result")
        return (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        b.size(len(s) * longest, "str.translate result")
    return args


def _check_replace(b: RenderBudget, s: str, old: str, new: str) -> None:
    hits = len(s) + 1 if not old else s.count(old)
    b.size(len(s) + hits * max(0, len(new) - len(old)), "a replace result")


# -- filters: every one counted, the expanding ones checked first -------------------------------

FilterCheck = Callable[[RenderBudget, object, tuple[object, ...], dict[str, object]], None]


def _arg(args: tuple[object, ...], kwargs: dict[str, object], i: int, name: str) -> object:
    return args[i] if len(args) > i else kwargs.get(name)


def _f_center(b: RenderBudget, value: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    width = _arg(args, kwargs, 0, "width")
    if isinstance(width, int):
        b.size(width, "a center width")


def _f_indent(b: RenderBudget, value: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    width = _arg(args, kwargs, 0, "width")
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 4
    text = value if isinstance(value, str) else ""
    b.size(len(text) + pad * (text.count("\n") + 1), "an indent result")


def _f_format(b: RenderBudget, value: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    if isinstance(value, str):
        _check_printf(b, value, (*args, *kwargs.values()))


def _f_replace(b: RenderBudget, value: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    old, new = _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new")
    if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
        _check_replace(b, value, old, new)


def _f_join(b: RenderBudget, value: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    sep = _arg(args, kwargs, 0, "d")
    if isinstance(value, (list, tuple)):
        sep_len = len(sep) if isinstance(sep, str) else 0
        b.size(sum(len(x) for x in value if isinstance(x, str)) + sep_len * len(value), "a join result")


def _f_fill(b: RenderBudget, value: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """batch(linecount, fill_with) and slice(slices, fill_with) pad up to their count."""
    count = _arg(args, kwargs, 0, "linecount") if "slices" not in kwargs else kwargs["slices"]
    if isinstance(count, int):
        b.size(count, "a batch or slice count")


def _f_sum(b: RenderBudget, value: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """Summing lists (start=[]) copies the growing list each time: quadratic."""
    start = _arg(args, kwargs, 1, "start")
    if isinstance(start, (list, tuple, str)) and isinstance(value, (list, tuple)):
        total = sum(len(x) for x in value if isinstance(x, (list, tuple, str)))
        b.size(total, "a sum result")
        if total * len(value) > b.alloc_chars:
            raise b.fail(f"a sum copying more than {b.alloc_chars:,} items")


def _f_tojson(b: RenderBudget, value: object, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    indent = _arg(args, kwargs, 1, "indent")
    width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, (int, float)) else 0
    if width > MAX_JSON_INDENT:
        raise b.fail(f"tojson indent {indent!r} is past the limit of {MAX_JSON_INDENT}")


_FILTER_CHECKS: dict[str, FilterCheck] = {
    "center": _f_center,
    "indent": _f_indent,
    "format": _f_format,
    "replace": _f_replace,
    "join": _f_join,
    "batch": _f_fill,
    "slice": _f_fill,
    "sum": _f_sum,
    "tojson": _f_tojson,
}


def _checked_filter(name: str, func: Callable[..., object]) -> Callable[..., object]:
    """`func` counted and checked. It takes the context (so Jinja never runs it at compile
    time, where a constant `'a'|center(9999999999)` would otherwise be built) and hands the
    original what it asked for."""
    pass_arg = getattr(func, "jinja_pass_arg", None)
    kind = pass_arg.name if pass_arg is not None else ""
    check = _FILTER_CHECKS.get(name)

    @jinja2.pass_context
    def checked(context: Context, value: object, *args: object, **kwargs: object) -> object:
        b = _budget()
        b.step()
        if check is not None:
            check(b, value, args, kwargs)
        if kind == "context":
            out = func(context, value, *args, **kwargs)
        elif kind == "eval_context":
            out = func(context.eval_ctx, value, *args, **kwargs)
        elif kind == "environment":
            out = func(context.environment, value, *args, **kwargs)
        else:
            out = func(value, *args, **kwargs)
        return b.result(out)

    return checked


@jinja2.pass_context
def _counted_filter(context: Context, value: Iterable[object]) -> Iterator[object]:
    """What every `for` loop iterates: the items of its iterable, one step each."""
    return _counted(value)


def _counted(items: Iterable[object]) -> Iterator[object]:
    b = _budget()
    for item in items:
        b.step()
        yield item


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    """Jinja's lipsum global, with its counts bounded (it builds n paragraphs of up to max words)."""
    b = _budget()
    b.size(n * max, "a lipsum text")
    return str(b.result(generate_lorem_ipsum(n, html, min, max)))


# -- the environment ----------------------------------------------------------------------------


class _CountingCodeGenerator(CodeGenerator):
    """Jinja's code generator, with every loop's iterable counted and every `~` concatenation
    checked: the two things a template does without a call the sandbox sees."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        for loop in node.find_all(nodes.For):
            counted = nodes.Filter(loop.iter, _ITER_FILTER, [], [], None, None, lineno=loop.iter.lineno)
            counted.set_environment(self.environment)
            loop.iter = counted
        super().visit_Template(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_value(")
        super().visit_Concat(node, frame)
        self.write(")")


def _checked_concat(parts: Iterable[str]) -> str:
    """Captured output (`{% set x %}`, macros, filter blocks) joined, its size checked first."""
    items = parts if isinstance(parts, list) else list(parts)
    b = _budget()
    n = sum(map(len, items))
    if n > b.output_chars:
        raise b.fail(f"captured output of {n:,} characters is past the limit of {b.output_chars:,}")
    b.built(n)
    return "".join(items)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, counting and checking against the current render's budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _CountingCodeGenerator
    concat = staticmethod(_checked_concat)

    def __init__(self) -> None:
        # the options Hugging Face and llama.cpp's Jinja engine use; an undefined value's member
        # is undefined too, as in llama.cpp's engine (`messages[0]['role']` on no messages)
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], undefined=ChainableUndefined
        )
        self.filters = {name: _checked_filter(name, f) for name, f in self.filters.items()}
        self.filters[_ITER_FILTER] = _counted_filter
        self.globals["lipsum"] = _lipsum

    def add_filter(self, name: str, func: Callable[..., object]) -> None:
        """Install a filter, counted and checked like the built-in ones."""
        self.filters[name] = _checked_filter(name, func)

    def checked_value(self, value: object) -> object:
        b = _budget()
        b.step()
        return b.result(value)

    def call_binop(self, context: Context, operator: str, left: object, right: object) -> object:
        b = _budget()
        b.step()
        _check_binop(b, operator, left, right)
        return b.result(super().call_binop(context, operator, left, right))

    def call(__self, __context: Context, __obj: object, *args: object, **kwargs: object) -> object:
        b = _budget()
        b.step()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            args = _check_str_method(b, owner, getattr(__obj, "__name__", ""), args)
        elif isinstance(__obj, LoopContext) and args and isinstance(args[0], Iterable):
            args = (_counted(args[0]), *args[1:])  # a recursive loop's next level
        return b.result(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: object, attribute: str) -> object | Undefined:
        _budget().step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: object, argument: str | object) -> object | Undefined:
        _budget().step()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: object) -> Callable[..., str] | None:
        """str.format and format_map as the sandbox wraps them, widths checked first."""
        wrapped = super().wrap_str_format(value)
        fmt = getattr(value, "__self__", None)
        if wrapped is None or not isinstance(fmt, str):
            return wrapped
        is_map = getattr(value, "__name__", "") == "format_map"

        def checked(*args: object, **kwargs: object) -> str:
            b = _budget()
            b.step()
            mapping = args[0] if is_map and args and isinstance(args[0], dict) else {}
            _check_format(b, fmt, () if is_map else args, {**mapping, **kwargs})
            return str(b.result(wrapped(*args, **kwargs)))

        return checked
