"""Issue 32: a chat template cannot freeze the process or exhaust its memory.

A template from a GGUF file is untrusted code. Each render runs under a budget (steps, time,
sizes: engine/chat/sandbox.py) and a template past it fails with one ChatTemplateError line
naming the template and the limit, within seconds and without growing the process. Real
templates render exactly as the plain Jinja sandbox renders them.
"""

from __future__ import annotations

import resource
import time

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ubatch.engine.chat import sandbox
from ubatch.engine.chat.jinja_env import _raise_exception, _tojson, compile_jinja
from ubatch.engine.chat.template import ChatTemplate, ChatTemplateError, apply_chat_template, load_template

FAST_S = 30.0  # a refusal takes milliseconds, the unbounded cases ran for minutes: a hang guard, not a benchmark
M = [{"role": "user", "content": "hi"}]


def rss_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def refused(template: str, *needles: str, messages: list[dict[str, str]] = M) -> str:
    t = time.perf_counter()
    with pytest.raises(ChatTemplateError) as e:
        apply_chat_template(messages, template)
    assert time.perf_counter() - t < FAST_S
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("chat template"), msg
    for n in needles:
        assert n in msg, msg
    return msg


HOSTILE = {  # the issue's probes first, then other ways to spend time or memory
    "nested-range": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    "string-times": ("{{ 'A' * 4000000000 }}", "4,000,000,000 characters"),
    "tojson-indent-float": ("{{ messages | tojson(indent=2e9) }}", "tojson indent"),
    "tojson-indent-int": ("{{ {'a': [1]} | tojson(indent=2000000000) }}", "tojson indent"),
    "list-times": ("{{ [1, 2] * 3000000000 }}", "past the limit"),
    "list-of-range-loops": (
        "{% set l = range(100000) | list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}",
        "steps",
    ),
    "loop-filter": ("{% for i in range(100000) if i < 0 %}{% endfor %}" * 30, "steps"),
    "doubling-tilde": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "past the limit",
    ),
    "doubling-plus": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "past the limit",
    ),
    "doubling-capture": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set x %}{{ ns.s }}{{ ns.s }}{% endset %}"
        "{% set ns.s = x %}{% endfor %}",
        "past the limit",
    ),
    "doubling-macro": (
        "{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='ab') %}"
        "{% for i in range(64) %}{% set ns.s = twice(ns.s) %}{% endfor %}",
        "past the limit",
    ),
    "center-filter": ("{{ 'a' | center(4000000000) }}", "center width"),
    "center-method": ("{{ 'a'.center(4000000000) }}", "str.center width"),
    "ljust-method": ("{{ 'a'.ljust(4000000000, 'x') }}", "str.ljust width"),
    "format-width": ("{{ '{:>4000000000}'.format('a') }}", "format width"),
    "format-nested-width": ("{{ '{:{}}'.format('a', 4000000000) }}", "format width"),
    "printf-width": ("{{ '%4000000000s' % 'a' }}", "printf width"),
    "printf-star": ("{{ '%*s' % (4000000000, 'a') }}", "printf width"),
    "format-filter": ("{{ '%4000000000d' | format(1) }}", "printf width"),
    "replace-growth": ("{{ ('a' * 1000000) | replace('a', 'aaaaaaaaaa') }}", "replace result"),
    "replace-method": ("{{ ('a' * 1000000).replace('a', 'aaaaaaaaaa') }}", "replace result"),
    "indent-width": ("{{ ('a\\n' * 1000000) | indent(1000) }}", "indent result"),
    "join-method": ("{{ ''.join(['a' * 3000000] * 2) }}", "join result"),
    "join-filter": ("{{ (['a' * 3000000] * 2) | join }}", "join result"),
    "batch-fill": ("{{ [1] | batch(4000000000, 0) | list }}", "batch or slice count"),
    "sum-lists": ("{{ ([[0] * 100000] * 100) | sum(start=[]) | length }}", "sum"),
    "expandtabs": ("{{ ('\\t' * 1000000).expandtabs(100) }}", "expandtabs"),
    "big-power": ("{{ 10 ** 100000000 }}", "bits"),
    "repeated-squaring": (
        "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
        "bits",
    ),
    "lipsum": ("{{ lipsum(1000000000) }}", "lipsum"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 4000000 }}{% endfor %}", "the prompt passed"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_refused_quickly(name: str) -> None:
    template, needle = HOSTILE[name]
    refused(template, needle, "rendering stopped")


TIMED = {  # few steps, each costly: stopped by the clock
    "exponential-macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "recursive-loop": "{% for i in range(100000) recursive %}{% if loop.depth < 4 %}{{ loop(range(100000)) }}{% endif %}{% endfor %}",
    "big-strings": "{% for i in range(100000) %}{{ ('ab' * 1000000) | upper | length }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(TIMED))
def test_slow_template_is_stopped_by_the_clock_or_the_steps(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "MAX_RENDER_SECONDS", 0.5)
    msg = refused(TIMED[name], "rendering stopped")
    assert "0.5 s" in msg or "steps" in msg or "characters of strings" in msg, msg


def test_the_default_deadline_holds() -> None:
    msg = refused(TIMED["exponential-macro"])
    assert f"longer than {sandbox.MAX_RENDER_SECONDS:g} s" in msg or "steps" in msg, msg


def test_hostile_templates_do_not_grow_the_process() -> None:
    """Every probe above, one after the other: the peak RSS moves by less than 100 MiB (the
    issue's probes reached 6 GB)."""
    before = rss_mib()
    for template, _ in HOSTILE.values():
        with pytest.raises(ChatTemplateError):
            apply_chat_template(M, template)
    assert rss_mib() - before < 100


def test_compiling_a_hostile_template_builds_nothing() -> None:
    """Jinja folds constants at compile time: `'A' * 4000000000` used to be built by loading
    the template, before any render. Intercepted operators and filters are never folded."""
    before, t = rss_mib(), time.perf_counter()
    for template in (
        "{{ 'A' * 4000000000 }}",
        "{{ {} | tojson(indent=2000000000) }}",
        "{{ 'a' | center(4000000000) }}",
    ):
        assert load_template(template) == template
    assert time.perf_counter() - t < FAST_S and rss_mib() - before < 50


def test_deeply_nested_template_is_a_one_line_error() -> None:
    with pytest.raises(ChatTemplateError) as e:
        compile_jinja("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "deep.jinja")
    assert str(e.value).startswith("deep.jinja: invalid Jinja chat template") and "\n" not in str(e.value)


def test_the_error_names_the_template_and_the_limit() -> None:
    t = ChatTemplate.from_metadata({"tokenizer.chat_template": HOSTILE["nested-range"][0]}, "llama")
    with pytest.raises(ChatTemplateError) as e:
        t.apply(M)
    assert str(e.value) == (
        "chat template (GGUF tokenizer.chat_template): rendering stopped: "
        f"more than {sandbox.MAX_RENDER_STEPS:,} steps (loop iterations, calls, lookups) in one render"
    )


def test_each_render_has_its_own_budget() -> None:
    """1.5 million steps twice: each render is under the limit on its own."""
    heavy = "{% for i in range(100000) %}{% for j in range(15) %}{% endfor %}{% endfor %}ok"
    assert apply_chat_template(M, heavy) == "ok"
    assert apply_chat_template(M, heavy) == "ok"


def test_long_messages_fit_the_budget() -> None:
    """Sizes scale with the messages: a 6-million-character message renders (chatml copies it
    once, a template may also copy it a few times)."""
    big = [{"role": "user", "content": "x" * 6_000_000}]
    chatml = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    )
    assert len(apply_chat_template(big, chatml)) == 6_000_000 + len("<|im_start|>user\n<|im_end|>\n")
    twice = "{{ messages[0]['content'] ~ messages[0]['content'] | upper }}"
    assert len(apply_chat_template(big, twice)) == 12_000_000


# -- real templates render exactly as before -------------------------------------------------

# Real-world template features: macros, captured blocks, filter blocks, loop variables and
# filters, recursive loops, tools as JSON, string methods, formatting, namespaces, loopcontrols.
RICH = r"""{%- macro render_tool(t) -%}
{{ t.name }}({{ t.parameters | tojson(indent=2) }})
{%- endmacro -%}
{%- set ns = namespace(system='', n=0) -%}
{%- for m in messages if m.role == 'system' -%}{%- set ns.system = ns.system ~ m.content | trim -%}{%- endfor -%}
{%- set header -%}
<sys>{{ ns.system | default('none', true) }}</sys>
{%- endset -%}
{{ header | upper }}
{% for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif -%}
[{{ loop.index }}/{{ loop.length }}{{ '*' if loop.last }}] {{ '%-9s' % m.role }}|{{ '{:>6}'.format(loop.revindex) }}
{{- m.content.strip().split(' ') | map('upper') | join('_') }}
{%- if m.tool_calls is defined %}{% for c in m.tool_calls %} -> {{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}
{%- set ns.n = ns.n + m.content | length %}
{% endfor -%}
{%- for t in tools %}{{ render_tool(t) }}{% if not loop.last %};{% endif %}{% endfor %}
{% for item in tree recursive %}<{{ item.name }}>{% if item.children %}{{ loop(item.children) }}{% endif %}</{{ item.name }}>{% endfor %}
{%- filter indent(2, true) %}
total={{ ns.n }} avg={{ '%.2f' % (ns.n / (messages | length)) }} pow={{ 2 ** 10 }} rep={{ '-' * 5 }}
{{ (messages | map(attribute='role') | list | unique | sort) | join(',') }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }}
{% for pair in [1, 2, 3, 4, 5] | batch(2, 0) %}{{ pair | sum }}{{ loop.cycle('a', 'b') }}{% endfor %} {{ [3, 1, 2] | slice(2) | list }}
{% for k, v in {'b': 1, 'a': 2} | dictsort %}{{ k }}{{ v }}{% if k == 'a' %}{% break %}{% endif %}{% endfor %} {{ 'x' | center(7) }}|{{ 'Word' | wordwrap(3) }}
{%- endfilter %}
{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"""

RICH_VARS: dict[str, object] = {
    "messages": [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "hello there world"},
        {
            "role": "assistant",
            "content": "calling it",
            "tool_calls": [{"function": {"name": "get", "arguments": {"q": "é", "n": [1, 2]}}}],
        },
        {"role": "user", "content": "thanks"},
    ],
    "tools": [{"name": "get", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}],
    "tree": [{"name": "a", "children": [{"name": "b", "children": []}, {"name": "c", "children": [{"name": "d"}]}]}],
    "add_generation_prompt": True,
    "bos_token": "<s>",
}


def plain_render(source: str, variables: dict[str, object]) -> str:
    """The environment templates rendered in before the budget: Jinja's immutable sandbox."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source).render(variables)


def test_a_feature_rich_template_renders_exactly_as_the_plain_sandbox() -> None:
    expected = plain_render(RICH, RICH_VARS)
    for piece in ("[4/4*] user", 'get({\n  "type"', "<a><b></b><c><d></d></c></a>", "pow=1024", "3a7b5a", "|Wor\n"):
        assert piece in expected, piece  # the features ran
    assert sandbox.render(compile_jinja(RICH), "t", 0, RICH_VARS) == expected


def test_the_real_templates_of_the_tests_render_as_before() -> None:
    import test_chat_template as tct

    msgs = [
        {"role": "system", "content": "Be brief."},
        *[{"role": r, "content": f" {r} text "} for r in ("user", "assistant", "user")],
    ]
    for source in (tct.GEMMA3_JINJA, tct.CHATML_JINJA, tct.LLAMA3_JINJA):
        for gen in (True, False):
            variables: dict[str, object] = {
                "messages": msgs,
                "add_generation_prompt": gen,
                "bos_token": "<b>",
                "eos_token": "<e>",
            }
            assert sandbox.render(compile_jinja(source), "t", 0, variables) == plain_render(source, variables)
