"""Chat templates: messages -> the prompt text a model was trained on (no printing).

Two ways to render, as llama.cpp has them (reference/gguf-models.md §5):

* the Jinja template from the GGUF (`tokenizer.chat_template`), rendered with `jinja2` in a
  sandbox with the variables llama.cpp and Hugging Face pass (`messages`,
  `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `strftime_now`);
* llama.cpp's built-in formats (every name of its LLM_CHAT_TEMPLATES: chatml, llama2,
  mistral-v7, phi4, gemma, llama3, deepseek3, ...), written as its `llm_chat_apply_template`
  writes them (engine/chat/formats.py).

`detect_template` picks the built-in format the way `llm_chat_detect_template` does; with no
template in the file, gemma-architecture models get `gemma` (llama.cpp falls back to ChatML,
which is wrong for Gemma: `<|im_start|>` is not a token of its vocabulary) and others `chatml`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ubatch.engine.chat.formats import BUILTIN, DS_ASSISTANT, DS_EOS, DS_USER, HY_ASSISTANT, HY_BOS, HY_HOLDER_3, NAMED
from ubatch.engine.chat.jinja_env import ChatTemplateError, compile_jinja, render_jinja
from ubatch.engine.model.archs import ARCHS

if TYPE_CHECKING:
    from ubatch.engine.model.model import Model


BUILTIN_TEMPLATES = tuple(NAMED)  # the names --chat-template accepts, as llama.cpp's table has them
JINJA = "jinja"  # detect_template's answer for a template only Jinja can render

# -- detection --------------------------------------------------------------------------------


def detect_template(tmpl_source: str | None, arch: str) -> str:
    """The built-in format for a template source (llama.cpp's detection), or "jinja".

    * no template: the architecture's own (engine/model/archs), "gemma" for other gemma*
      architectures, otherwise "chatml" (llama.cpp's fallback);
    * otherwise what `llama_cpp_detect` finds: an exact built-in name, or the first of
      llama.cpp's substring tests that matches; "jinja" where none does (only the source itself
      can render it, and --no-jinja cannot).
    """
    if not tmpl_source:
        if arch in ARCHS:
            return ARCHS[arch].chat_template
        return "gemma" if arch.startswith("gemma") else "chatml"
    return llama_cpp_detect(tmpl_source) or JINJA


def llama_cpp_detect(t: str) -> str | None:
    """llm_chat_detect_template: the built-in format a template source names or resembles (its
    branches in its order), None where llama.cpp finds none."""
    if t in NAMED:
        return t

    def has(*needles: str) -> bool:
        return all(n in t for n in needles)

    if has("<|im_start|>"):  # smolvlm uses <|im_start|> as its BOS but is not ChatML
        return "phi4" if has("<|im_sep|>") else "smolvlm" if has("<end_of_utterance>") else "chatml"
    if t.startswith("mistral") or has("[INST]"):
        if has("[SYSTEM_PROMPT]"):
            return "mistral-v7"
        if has("' [INST] ' + system_message") or has("[AVAILABLE_TOOLS]"):  # Mistral's own v1, v3, v3-tekken
            return "mistral-v1" if has(" [INST]") else "mistral-v3-tekken" if has('"[INST]"') else "mistral-v3"
        if has("content.strip()"):
            return "llama2-sys-strip"
        if has("bos_token + '[INST]"):
            return "llama2-sys-bos"
        return "llama2-sys" if has("<<SYS>>") else "llama2"
    if has("<|assistant|>", "<|end|>"):
        return "phi3"
    if has("[gMASK]<sop>"):
        return "chatglm4"
    if has("<|assistant|>", "<|user|>"):
        if has("<|tool_declare|>"):
            return "exaone-moe"
        return "falcon3" if has("</s>") else "glmedge"
    if has("<|{{ item['role'] }}|>", "<|begin_of_image|>"):
        return "glmedge"
    for needles, name in _DETECT:
        if has(*needles):
            return name
    return None


# llm_chat_detect_template's later tests, in its order: all the needles present -> the format
_DETECT: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|user|>", "<|endoftext|>"), "zephyr"),
    (("bos_token + message['role']",), "monarch"),
    (("<start_of_turn>",), "gemma"),
    (("'\\n\\nAssistant: ' + eos_token",), "orion"),  # OrionStarAI/Orion-14B-Chat
    (("GPT4 Correct ",), "openchat"),  # openchat/openchat-3.5-0106
    (("USER: ", "ASSISTANT: ", "SYSTEM: "), "vicuna-orca"),
    (("USER: ", "ASSISTANT: "), "vicuna"),  # eachadea/vicuna-13b-1.1
    (("### Instruction:", "<|EOT|>"), "deepseek"),  # deepseek-coder-33b-instruct
    (("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>"), "command-r"),
    (("<|start_header_id|>", "<|end_header_id|>"), "llama3"),
    (("[gMASK]sop",), "chatglm3"),
    (("<用户>",), "minicpm"),
    (("'Assistant: ' + message['content'] + eos_token",), "deepseek2"),
    ((DS_ASSISTANT, DS_USER, DS_EOS), "deepseek3"),
    (("[|system|]", "[|assistant|]", "[|endofturn|]", "[|tool|]"), "exaone4"),
    (("[|system|]", "[|assistant|]", "[|endofturn|]"), "exaone3"),
    (("rwkv-world",), "rwkv-world"),
    (("{{- 'User: ' + message['content']|trim + '\\n\\n' -}}",), "rwkv-world"),
    (("<|start_of_role|>", "<tool_call>", "g4_default_system_message"), "granite-4.0"),
    (("<|start_of_role|>", "<tools>", "g4_default_system_message"), "granite-4.0"),
    (("<|start_of_role|>", "<tool_call>"), "granite-4.1"),
    (("<|start_of_role|>", "<tools>"), "granite-4.1"),
    (("<|start_of_role|>",), "granite"),
    (
        ("message['role'] + additional_special_tokens[0] + message['content'] + additional_special_tokens[1]",),
        "gigachat",
    ),
    (("<|role_start|>",), "megrez"),
    ((" Ассистент:",), "yandex"),
    (("<role>ASSISTANT</role>", "'HUMAN'"), "bailing"),
    (("<role>ASSISTANT</role>", '"HUMAN"', "<think>"), "bailing-think"),
    (("<role>ASSISTANT</role>", "<role>HUMAN</role>", "<|role_end|>"), "bailing2"),
    (("<|header_start|>", "<|header_end|>"), "llama4"),
    (("<|endofuserprompt|>",), "dots1"),
    (("<|extra_0|>", "<|extra_4|>"), "hunyuan-moe"),
    (("<|start|>", "<|channel|>"), "gpt-oss"),
    ((HY_ASSISTANT, HY_BOS), "hunyuan-vl"),
    ((HY_ASSISTANT, HY_HOLDER_3), "hunyuan-dense"),
    (("<|im_assistant|>assistant<|im_middle|>",), "kimi-k2"),
    (("<seed:bos>",), "seed_oss"),
    (("'Assistant: '  + message['content'] + '<|separator|>",), "grok-2"),
    (("[unused9]系统：[unused10]",), "pangu-embedded"),
    (("<|begin|>", "<|end|>", "<|content|>"), "solar-open"),
)


# -- loading ----------------------------------------------------------------------------------


def _is_file(s: str) -> bool:
    """Whether `s` names an existing file; an inline Jinja text too long for a path (OSError:
    File name too long) or holding a NUL (ValueError) is not one."""
    try:
        return Path(s).is_file()
    except (OSError, ValueError):
        return False


def load_template(name_or_file: str) -> str:
    """`--chat-template NAME|FILE|JINJA`: a built-in name, a Jinja file's text, or inline Jinja.

    Raises ChatTemplateError (one line) for an unknown name, an unreadable or non-UTF-8 file,
    or Jinja that does not compile.
    """
    s = name_or_file
    if s in BUILTIN_TEMPLATES:
        return s
    if "{{" in s or "{%" in s:  # inline Jinja source, as llama.cpp's --chat-template accepts
        compile_jinja(s, "the --chat-template text")
        return s
    p = Path(s)
    if not _is_file(s):
        raise ChatTemplateError(
            f"unknown chat template {s!r}: not a file, not Jinja and not a llama.cpp built-in ({', '.join(BUILTIN_TEMPLATES)})"
        )
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ChatTemplateError(f"{s}: cannot read chat template ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{s}: chat template is not UTF-8 text (invalid byte at offset {e.start})") from None
    if not text.strip():
        raise ChatTemplateError(f"{s}: chat template file is empty")
    compile_jinja(text, s)
    return text


# -- rendering --------------------------------------------------------------------------------


def _content_text(content: object, i: int) -> str:
    """A message's text: a string, None, or OpenAI-style parts (text parts joined by "\\n",
    as llama.cpp's legacy path does; other parts ignored)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or "type" not in part:
                raise ChatTemplateError(f"message {i}: content parts must be objects with a 'type'")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ChatTemplateError(f"message {i}: a text part needs a string 'text'")
                texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError(f"message {i}: content must be a string or a list of parts")


def _size(value: object) -> int:
    """About how many characters a message field holds (what a template may copy out of it)."""
    return len(value) if isinstance(value, str) else len(str(value))


@dataclass(frozen=True, slots=True)
class Message:
    """A checked message: its role and text, and all its fields (content as that text) for Jinja."""

    role: str
    content: str
    fields: dict[str, object]


def normalize_messages(messages: Sequence[Mapping[str, object]]) -> list[Message]:
    """Check the messages (JSON objects with a role) and flatten content parts to text."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"message {i} is not an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"message {i} has no role")
        content = _content_text(m.get("content"), i)
        out.append(Message(role, content, {**m, "content": content}))
    return out


def apply_chat_template(
    messages: Sequence[Mapping[str, object]],
    template: str,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    *,
    add_bos: bool = True,
    add_eos: bool = False,
    origin: str = "",
    tools: Sequence[Mapping[str, object]] | None = None,
    extra_context: Mapping[str, object] | None = None,
) -> str:
    """Render `messages` with a built-in format name or a Jinja source.

    `tools` (OpenAI's `[{type: function, function: {...}}]`, as llama.cpp passes them) and
    `extra_context` (`enable_thinking`, chat_template_kwargs) reach a Jinja template as
    variables; built-in formats know neither (engine/chat/tools puts tools in the messages).

    For Jinja, a rendered text that starts with `bos_token` loses it when the vocab adds BOS
    itself (`add_bos`), and one that ends with `eos_token` loses it when the vocab adds EOS,
    as llama.cpp's common/chat.cpp does; built-in formats never write BOS. Rendering is
    bounded (engine/chat/sandbox.py): a template past a limit is a ChatTemplateError naming
    the template (`origin`: where it came from) and the limit.
    """
    msgs = normalize_messages(messages)
    if template in BUILTIN:
        return BUILTIN[template]([(m.role, m.content) for m in msgs], add_generation_prompt)
    if not ("{{" in template or "{%" in template):
        raise ChatTemplateError(
            f"unknown chat template {template[:40]!r}: use one of {', '.join(BUILTIN_TEMPLATES)} or a Jinja source"
        )
    import jinja2

    what = f"chat template ({origin})" if origin else "chat template"
    tmpl = compile_jinja(template, what)
    variables: dict[str, object] = dict(extra_context or {})
    variables.update(
        {
            "messages": [m.fields for m in msgs],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos_token,
            "eos_token": eos_token,
        }
    )
    input_chars = len(bos_token) + len(eos_token) + sum(_size(v) for m in msgs for v in m.fields.values())
    if tools:
        variables["tools"] = [dict(t) for t in tools]
        input_chars += sum(_size(t) for t in tools)
    try:
        text = render_jinja(tmpl, what, input_chars, variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e.message or type(e).__name__}") from None
    except Exception as e:  # a template bug (e.g. indexing a missing key): still one line
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    if add_bos and bos_token and text.startswith(bos_token):
        text = text[len(bos_token) :]
    if add_eos and eos_token and text.endswith(eos_token):
        text = text[: -len(eos_token)]
    return text


# -- a model's template -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """The template a conversation uses, and where it came from (for the startup log)."""

    name: str  # the family: "gemma", "chatml", "llama3", or "jinja" (unknown family)
    source: str | None  # Jinja source when rendered through Jinja; None for a built-in format
    origin: str  # e.g. "GGUF tokenizer.chat_template", "built-in: no template in the GGUF"
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = True
    add_eos: bool = False

    @property
    def describe(self) -> str:
        kind = "Jinja" if self.source is not None else "built-in"
        return f"{self.name} ({kind}; {self.origin})"

    def apply(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        extra_context: Mapping[str, object] | None = None,
    ) -> str:
        return apply_chat_template(
            messages,
            self.source if self.source is not None else self.name,
            add_generation_prompt,
            self.bos_token,
            self.eos_token,
            add_bos=self.add_bos,
            add_eos=self.add_eos,
            origin=self.origin,
            tools=tools,
            extra_context=extra_context,
        )

    @classmethod
    def from_metadata(
        cls,
        metadata: Mapping[str, object],
        arch: str,
        bos_token: str = "",
        eos_token: str = "",
        add_bos: bool = True,
        add_eos: bool = False,
        override: str | None = None,
        use_jinja: bool = True,
    ) -> ChatTemplate:
        """The GGUF's template (or `override`, a --chat-template value) for a model.

        use_jinja=False (llama.cpp's --no-jinja) renders the detected built-in format instead
        of the Jinja source, and fails for a template of another family.
        """
        toks = (bos_token, eos_token, add_bos, add_eos)
        if override is not None:
            src = load_template(override)
            if src in BUILTIN_TEMPLATES:
                return cls(src, None, "--chat-template", *toks)
            name = detect_template(src, arch)
            origin = f"--chat-template {Path(override).name}" if _is_file(override) else "--chat-template"
            return cls._jinja_or_builtin(name, src, origin, use_jinja, toks)
        stored = metadata.get("tokenizer.chat_template")
        if isinstance(stored, str) and stored.strip():
            name = detect_template(stored, arch)
            return cls._jinja_or_builtin(name, stored, "GGUF tokenizer.chat_template", use_jinja, toks)
        name = detect_template(None, arch)
        why = "gemma architecture" if name == "gemma" else "llama.cpp's fallback"
        return cls(name, None, f"no template in the GGUF, {why}", *toks)

    @classmethod
    def _jinja_or_builtin(
        cls, name: str, src: str, origin: str, use_jinja: bool, toks: tuple[str, str, bool, bool]
    ) -> ChatTemplate:
        if use_jinja:
            compile_jinja(src, origin)
            return cls(name, src, origin, *toks)
        if name == JINJA:
            raise ChatTemplateError(
                f"the chat template ({origin}) is not one of the built-in formats {', '.join(BUILTIN_TEMPLATES)}; drop --no-jinja"
            )
        return cls(name, None, f"detected from the {origin}", *toks)

    @classmethod
    def for_model(cls, model: Model, override: str | None = None, use_jinja: bool = True) -> ChatTemplate:
        v = model.vocab
        return cls.from_metadata(
            model.gguf.metadata,
            model.hparams.arch,
            bos_token=v.token_text(v.bos),
            eos_token=v.token_text(v.eos),
            add_bos=v.add_bos,
            add_eos=v.add_eos,
            override=override,
            use_jinja=use_jinja,
        )
