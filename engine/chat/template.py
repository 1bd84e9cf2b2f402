"""Chat templates: messages -> the prompt text a model was trained on (no printing).

Two ways to render, as llama.cpp has them (reference/gguf-models.md §5):

* the Jinja template from the GGUF (`tokenizer.chat_template`), rendered with `jinja2` in a
  sandbox with the variables llama.cpp and Hugging Face pass (`messages`,
  `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `strftime_now`);
* the built-in formats `gemma`, `chatml` and `llama3`, written as llama.cpp's
  `llm_chat_apply_template` writes them.

`detect_template` picks the built-in family the way `llm_chat_detect_template` does; with no
template in the file, gemma-architecture models get `gemma` (llama.cpp falls back to ChatML,
which is wrong for Gemma: `<|im_start|>` is not a token of its vocabulary) and others `chatml`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ubatch.engine.chat.formats import BUILTIN
from ubatch.engine.chat.jinja_env import ChatTemplateError, compile_jinja, render_jinja

if TYPE_CHECKING:
    from ubatch.engine.model.model import Model


BUILTIN_TEMPLATES = ("chatml", "gemma", "llama3")
JINJA = "jinja"  # detect_template's answer for a template only Jinja can render

# llama.cpp's other built-in names (src/llama-chat.cpp): recognised, so the error can say so
_LLAMA_CPP_ONLY = tuple(
    "llama2 llama2-sys llama2-sys-bos llama2-sys-strip mistral-v1 mistral-v3 mistral-v3-tekken "
    "mistral-v7 mistral-v7-tekken phi3 phi4 falcon3 zephyr monarch orion openchat vicuna vicuna-orca "
    "deepseek deepseek2 deepseek3 command-r chatglm3 chatglm4 glmedge minicpm exaone3 exaone4 "
    "rwkv-world granite gigachat megrez yandex bailing llama4 smolvlm hunyuan-moe gpt-oss kimi-k2 "
    "seed_oss".split()
)


# -- detection --------------------------------------------------------------------------------


def detect_template(tmpl_source: str | None, arch: str) -> str:
    """The built-in format for a template source (llama.cpp's detection order), or "jinja".

    * no template: "gemma" for gemma* architectures, otherwise "chatml" (llama.cpp's fallback);
    * an exact built-in name: that name;
    * otherwise substring heuristics in llama.cpp's order: `<|im_start|>` -> chatml (phi4 and
      smolvlm variants -> jinja), ..., `<start_of_turn>` -> gemma, ...,
      `<|start_header_id|>` + `<|end_header_id|>` -> llama3; formats we do not write as
      built-ins, and templates nothing matches, -> "jinja" (render the source itself).
    """
    if not tmpl_source:
        return "gemma" if arch.startswith("gemma") else "chatml"
    t = tmpl_source
    if t in BUILTIN_TEMPLATES:
        return t
    if t in _LLAMA_CPP_ONLY:
        return JINJA

    def has(s: str) -> bool:
        return s in t

    if has("<|im_start|>"):
        return JINJA if has("<|im_sep|>") or has("<end_of_utterance>") else "chatml"
    if t.startswith("mistral") or has("[INST]"):
        return JINJA  # llama2 / mistral variants
    if has("<|assistant|>") and has("<|end|>"):
        return JINJA  # phi3
    if has("[gMASK]<sop>"):
        return JINJA  # chatglm4
    if has("<|assistant|>") and has("<|user|>"):
        return JINJA  # falcon3 / glmedge
    if has("<|user|>") and has("<|endoftext|>"):
        return JINJA  # zephyr
    if has("bos_token + message['role']"):
        return JINJA  # monarch
    if has("<start_of_turn>"):
        return "gemma"
    if has("<|start_header_id|>") and has("<|end_header_id|>"):
        return "llama3"
    return JINJA


# -- loading ----------------------------------------------------------------------------------


def load_template(name_or_file: str) -> str:
    """`--chat-template NAME|FILE|JINJA`: a built-in name, a Jinja file's text, or inline Jinja.

    Raises ChatTemplateError (one line) for an unknown name, an unreadable or non-UTF-8 file,
    or Jinja that does not compile.
    """
    s = name_or_file
    if s in BUILTIN_TEMPLATES:
        return s
    if s in _LLAMA_CPP_ONLY:
        raise ChatTemplateError(
            f"chat template {s!r} is a llama.cpp built-in that ubatch does not write; use {', '.join(BUILTIN_TEMPLATES)} or a Jinja template file"
        )
    if "{{" in s or "{%" in s:  # inline Jinja source, as llama.cpp's --chat-template accepts
        compile_jinja(s, "the --chat-template text")
        return s
    p = Path(s)
    if not p.exists():
        raise ChatTemplateError(
            f"unknown chat template {s!r}: not a file and not one of {', '.join(BUILTIN_TEMPLATES)}"
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
) -> str:
    """Render `messages` with a built-in format name or a Jinja source.

    For Jinja, a rendered text that starts with `bos_token` loses it when the vocab adds BOS
    itself (`add_bos`), and one that ends with `eos_token` loses it when the vocab adds EOS,
    as llama.cpp's common/chat.cpp does; built-in formats never write BOS. Rendering is
    bounded (engine/chat/sandbox.py): a template past a limit is a ChatTemplateError naming
    the template (`origin`: where it came from) and the limit.
    """
    msgs = normalize_messages(messages)
    if template in BUILTIN:
        return BUILTIN[template]([(m.role, m.content) for m in msgs], add_generation_prompt)
    if template in _LLAMA_CPP_ONLY or not ("{{" in template or "{%" in template):
        raise ChatTemplateError(
            f"unknown chat template {template[:40]!r}: use one of {', '.join(BUILTIN_TEMPLATES)} or a Jinja source"
        )
    import jinja2

    what = f"chat template ({origin})" if origin else "chat template"
    tmpl = compile_jinja(template, what)
    variables: dict[str, object] = {
        "messages": [m.fields for m in msgs],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    input_chars = len(bos_token) + len(eos_token) + sum(_size(v) for m in msgs for v in m.fields.values())
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

    def apply(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True) -> str:
        return apply_chat_template(
            messages,
            self.source if self.source is not None else self.name,
            add_generation_prompt,
            self.bos_token,
            self.eos_token,
            add_bos=self.add_bos,
            add_eos=self.add_eos,
            origin=self.origin,
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
            origin = f"--chat-template {Path(override).name}" if Path(override).exists() else "--chat-template"
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
