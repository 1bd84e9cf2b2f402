"""Chat templates: the built-in formats against the strings llama.cpp's llm_chat_apply_template
writes (reference/gguf-models.md §5; expected strings written from the reference, not from our
output), llama.cpp's detection order, Jinja rendering, and one-line errors for bad templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from ubatch.engine.chat.template import (
    ChatTemplate,
    ChatTemplateError,
    apply_chat_template,
    detect_template,
    load_template,
)
from ubatch.engine.errors import UbatchError

# Whitespace around the contents shows which formats trim (gemma, llama3) and which do not (chatml).
THREE = [
    {"role": "system", "content": "  Be brief. "},
    {"role": "user", "content": " Hi there\n"},
    {"role": "assistant", "content": "Hello! "},
]
# the reference's [verified] gemma example: the same plus a second user message
FOUR = THREE + [{"role": "user", "content": "What is 2+2?"}]


# -- built-in formats -------------------------------------------------------------------------


def test_gemma_three_messages() -> None:
    # system: trimmed, held back, written at the start of the next non-model turn + "\n\n";
    # assistant -> model; every content trimmed; no BOS text (the tokenizer adds <bos>)
    assert apply_chat_template(THREE, "gemma", add_generation_prompt=False) == (
        "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
    )
    assert apply_chat_template(THREE, "gemma") == (
        "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>model\n"
    )


def test_gemma_matches_the_verified_reference_string() -> None:
    assert apply_chat_template(FOUR, "gemma") == (
        "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!"
        "<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_chatml_three_messages_not_trimmed() -> None:
    assert apply_chat_template(THREE, "chatml", add_generation_prompt=False) == (
        "<|im_start|>system\n  Be brief. <|im_end|>\n<|im_start|>user\n Hi there\n<|im_end|>\n<|im_start|>assistant\nHello! <|im_end|>\n"
    )
    assert apply_chat_template(THREE, "chatml").endswith("Hello! <|im_end|>\n<|im_start|>assistant\n")


def test_llama3_three_messages() -> None:
    assert apply_chat_template(THREE, "llama3") == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert apply_chat_template(THREE, "llama3", add_generation_prompt=False).endswith("Hello!<|eot_id|>")


def test_conversation_of_user_assistant_user() -> None:
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    assert apply_chat_template(msgs, "gemma") == (
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    assert apply_chat_template(msgs, "chatml") == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gemma_system_prompt_waits_for_a_non_model_turn() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "U"}]
    assert apply_chat_template(msgs, "gemma", add_generation_prompt=False) == (
        "<start_of_turn>model\nA<end_of_turn>\n<start_of_turn>user\nS\n\nU<end_of_turn>\n"
    )


def test_content_parts_are_joined_text() -> None:
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
        }
    ]
    assert apply_chat_template(msgs, "chatml", False) == "<|im_start|>user\na\nb<|im_end|>\n"


# -- detection (llm_chat_detect_template's order) ---------------------------------------------


@pytest.mark.parametrize(
    "source, arch, expected",
    [
        (None, "gemma3", "gemma"),  # no template: by architecture (llama.cpp would say chatml)
        ("", "gemma", "gemma"),
        (None, "llama", "chatml"),  # llama.cpp's fallback
        ("gemma", "llama", "gemma"),  # an exact built-in name
        ("llama3", "gemma3", "llama3"),
        ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "llama", "chatml"),
        ("{{ '<|im_start|>' }}{{ '<|im_sep|>' }}", "llama", "phi4"),
        ("{{ '<start_of_turn>' + role }}", "llama", "gemma"),
        ("{{ '<|start_header_id|>' + r + '<|end_header_id|>' }}", "gemma3", "llama3"),
        ("{{ '<|start_header_id|>' }}", "gemma3", "jinja"),  # needs both header tokens
        ("[INST] {{ m }} [/INST]", "llama", "llama2"),  # no <<SYS>>, strip or BOS: plain llama2
        ("{{ '<|im_start|>' }}{{ '<start_of_turn>' }}", "llama", "chatml"),  # chatml is tested first
        ("{{ messages }}", "llama", "jinja"),
    ],
)
def test_detect_template(source: str | None, arch: str, expected: str) -> None:
    assert detect_template(source, arch) == expected


# -- Jinja --------------------------------------------------------------------------------------

# Google's Gemma 3 template has this structure (reference §5: BOS first, system + "\n\n" in front
# of the first message, untrimmed; roles must alternate; assistant -> model; contents trimmed).
GEMMA3_JINJA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

CHATML_JINJA = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Meta's Llama 3 instruct template
LLAMA3_JINJA = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_jinja_gemma3_equals_builtin_and_strips_bos() -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    out = apply_chat_template(msgs, GEMMA3_JINJA, True, bos_token="<bos>", eos_token="<eos>")
    assert out == apply_chat_template(msgs, "gemma")  # the rendered <bos> is dropped: the tokenizer adds it
    kept = apply_chat_template(msgs, GEMMA3_JINJA, True, bos_token="<bos>", add_bos=False)
    assert kept == "<bos>" + out
    assert detect_template(GEMMA3_JINJA, "gemma3") == "gemma"


def test_jinja_raise_exception_is_a_one_line_error() -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        apply_chat_template(bad, GEMMA3_JINJA, bos_token="<bos>")


def test_jinja_chatml_and_llama3_equal_the_builtins() -> None:
    assert apply_chat_template(THREE, CHATML_JINJA) == apply_chat_template(THREE, "chatml")
    out = apply_chat_template(THREE, LLAMA3_JINJA, bos_token="<|begin_of_text|>")
    assert out == apply_chat_template(THREE, "llama3")
    assert detect_template(CHATML_JINJA, "llama") == "chatml"
    assert detect_template(LLAMA3_JINJA, "llama") == "llama3"


def test_jinja_variables_and_filters() -> None:
    src = "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ messages | length }}|{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}"
    out = apply_chat_template(
        [{"role": "user", "content": "é"}], src, False, bos_token="B", eos_token="E", add_bos=False
    )
    assert out == 'B|E|False|1|{"role": "user", "content": "é"}|4'


def test_jinja_is_sandboxed() -> None:
    with pytest.raises(ChatTemplateError):
        apply_chat_template([{"role": "user", "content": "x"}], "{{ messages.__class__.__mro__[1].__subclasses__() }}")


# -- loading ------------------------------------------------------------------------------------


def test_load_template(tmp_path: Path) -> None:
    assert load_template("gemma") == "gemma"
    f = tmp_path / "t.jinja"
    f.write_text(CHATML_JINJA)
    assert load_template(str(f)) == CHATML_JINJA
    assert load_template(CHATML_JINJA) == CHATML_JINJA  # inline Jinja, as llama.cpp accepts
    long = CHATML_JINJA + "{# " + "x" * 5000 + " #}"  # longer than a path may be (ENAMETOOLONG)
    assert load_template(long) == long
    with pytest.raises(ChatTemplateError, match="unknown chat template"):
        load_template("y" * 5000)


@pytest.mark.parametrize(
    "case, needles",
    [
        ("syntax", ("bad.jinja", "invalid Jinja", "line 2")),
        ("missing", ("nope.jinja", "unknown chat template")),
        ("latin1", ("latin1.jinja", "UTF-8")),
        ("empty", ("empty.jinja", "empty")),
        ("name", ("gemma4", "unknown chat template", "chatml, llama2", "solar-open")),
    ],
)
def test_bad_templates_are_one_line_errors(tmp_path: Path, case: str, needles: tuple[str, ...]) -> None:
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    (tmp_path / "latin1.jinja").write_bytes("caf\xe9 {{ x }}".encode("latin-1"))
    (tmp_path / "empty.jinja").write_text("  \n")
    arg = {
        "syntax": tmp_path / "bad.jinja",
        "missing": tmp_path / "nope.jinja",
        "latin1": tmp_path / "latin1.jinja",
        "empty": tmp_path / "empty.jinja",
        "name": "gemma4",
    }[case]
    with pytest.raises(ChatTemplateError) as e:
        load_template(str(arg))
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, UbatchError)
    for n in needles:
        assert n in msg, (n, msg)


def test_bad_messages() -> None:
    with pytest.raises(ChatTemplateError, match="role"):
        apply_chat_template([{"content": "x"}], "chatml")
    with pytest.raises(ChatTemplateError, match="content"):
        apply_chat_template([{"role": "user", "content": 3}], "chatml")
    with pytest.raises(ChatTemplateError, match="unknown chat template"):
        apply_chat_template(THREE, "vicuna-ish")


# -- a model's template -------------------------------------------------------------------------


def test_template_from_metadata(tmp_path: Path) -> None:
    t = ChatTemplate.from_metadata({}, "gemma3", bos_token="<bos>")
    assert (t.name, t.source) == ("gemma", None) and "gemma architecture" in t.origin
    assert ChatTemplate.from_metadata({}, "llama").name == "chatml"
    meta = {"tokenizer.chat_template": GEMMA3_JINJA}
    t = ChatTemplate.from_metadata(meta, "gemma3", bos_token="<bos>")
    assert (t.name, t.source) == ("gemma", GEMMA3_JINJA) and "GGUF" in t.origin
    assert t.apply(FOUR[1:]) == apply_chat_template(FOUR[1:], "gemma")
    t = ChatTemplate.from_metadata(meta, "gemma3", use_jinja=False)  # --no-jinja: the detected format
    assert (t.name, t.source) == ("gemma", None)
    t = ChatTemplate.from_metadata(meta, "gemma3", override="chatml")  # --chat-template wins
    assert (t.name, t.source) == ("chatml", None)
    with pytest.raises(ChatTemplateError, match="no-jinja"):
        ChatTemplate.from_metadata({"tokenizer.chat_template": "{{ messages }}"}, "llama", use_jinja=False)
    f = tmp_path / "mine.jinja"
    f.write_text(LLAMA3_JINJA)
    t = ChatTemplate.from_metadata({}, "gemma3", override=str(f))
    assert t.name == "llama3" and t.source == LLAMA3_JINJA and "mine.jinja" in t.origin
    long = LLAMA3_JINJA + "{# " + "x" * 5000 + " #}"  # inline, too long to be a file name
    t = ChatTemplate.from_metadata({}, "gemma3", override=long)
    assert t.name == "llama3" and t.source == long and t.origin == "--chat-template"
