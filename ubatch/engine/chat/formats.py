"""The chat formats written out by hand, as llama.cpp's llm_chat_apply_template
(src/llama-chat.cpp) writes them: what a model gets from `--chat-template NAME`, and, with Jinja
off, from a template that llama.cpp's detection recognises.

Each format keeps llama.cpp's quirks, since a prompt that differs by one space is another
prompt: which contents are trimmed (C isspace only), which roles are dropped, and the formats
that ignore add_generation_prompt (the llama2 and mistral families, orion, minicpm, rwkv-world,
the hunyuan ones, deepseek-ocr) or add their own turn opener.
"""

from __future__ import annotations

from collections.abc import Callable

Turn = tuple[str, str]  # (role, content text) of a checked message
Format = Callable[[list[Turn], bool], str]
_WS = " \t\n\r\v\f"  # llama-chat.cpp's trim(): std::isspace

# DeepSeek's and Hunyuan's special tokens, spelled with their full-width bars and U+2581
DS_USER, DS_ASSISTANT, DS_EOS = (
    "<\uff5cUser\uff5c>",
    "<\uff5cAssistant\uff5c>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
)
HY_USER, HY_ASSISTANT = "<\uff5chy_User\uff5c>", "<\uff5chy_Assistant\uff5c>"
HY_BOS = "<\uff5chy_begin\u2581of\u2581sentence\uff5c>"
HY_HOLDER_2, HY_HOLDER_3 = (
    "<\uff5chy_place\u2581holder\u2581no\u25812\uff5c>",
    "<\uff5chy_place\u2581holder\u2581no\u25813\uff5c>",
)


def trim(s: str) -> str:
    """llama-chat.cpp's trim(): strip C isspace characters (not Unicode spaces) at both ends."""
    return s.strip(_WS)


def _upper(s: str) -> str:
    """C toupper per byte: ASCII letters only (a role's other characters stay as they are)."""
    return "".join(c.upper() if "a" <= c <= "z" else c for c in s)


# -- ChatML and its relatives --------------------------------------------------------------------


def _chatml(turns: list[Turn], add_ass: bool) -> str:
    out = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns]
    if add_ass:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _phi4(turns: list[Turn], add_ass: bool) -> str:
    out = [f"<|im_start|>{role}<|im_sep|>{content}<|im_end|>" for role, content in turns]
    if add_ass:
        out.append("<|im_start|>assistant<|im_sep|>")
    return "".join(out)


def _smolvlm(turns: list[Turn], add_ass: bool) -> str:
    out = ["<|im_start|>"]  # its BOS; the turns are not ChatML
    for role, content in turns:
        if role == "system":
            out.append(content + "\n\n")
        elif role == "user":
            out.append(f"User: {content}<end_of_utterance>\n")
        else:
            out.append(f"Assistant: {content}<end_of_utterance>\n")
    if add_ass:
        out.append("Assistant:")
    return "".join(out)


def _kimi_k2(turns: list[Turn], add_ass: bool) -> str:
    heads = {
        "system": "<|im_system|>system<|im_middle|>",
        "user": "<|im_user|>user<|im_middle|>",
        "assistant": "<|im_assistant|>assistant<|im_middle|>",
        "tool": "<|im_system|>tool<|im_middle|>",
    }
    out = [heads.get(role, "") + content + "<|im_end|>" for role, content in turns]
    if add_ass:
        out.append("<|im_assistant|>assistant<|im_middle|>")
    return "".join(out)


# -- Mistral and Llama 2 -------------------------------------------------------------------------


def _mistral_v7(trailing: str) -> Format:
    def render(turns: list[Turn], add_ass: bool) -> str:
        out = []
        for role, content in turns:
            if role == "system":
                out.append(f"[SYSTEM_PROMPT]{trailing}{content}[/SYSTEM_PROMPT]")
            elif role == "user":
                out.append(f"[INST]{trailing}{content}[/INST]")
            else:
                out.append(f"{trailing}{content}</s>")
        return "".join(out)

    return render


def _mistral(leading: str, trailing: str, trim_assistant: bool) -> Format:
    """v1 (" [INST] "), v3 ("[INST] ", the assistant's content trimmed), v3-tekken ("[INST]")."""

    def render(turns: list[Turn], add_ass: bool) -> str:
        out, inside = [], False
        for role, content in turns:
            if not inside:
                out.append(f"{leading}[INST]{trailing}")
                inside = True
            if role == "system":
                out.append(content + "\n\n")
            elif role == "user":
                out.append(f"{content}{leading}[/INST]")
            else:
                out.append(trailing + (trim(content) if trim_assistant else content) + "</s>")
                inside = False
        return "".join(out)

    return render


def _llama2(system: bool, bos_inside: bool, strip: bool) -> Format:
    """llama2 (a system turn written bare), -sys (<<SYS>>), -sys-bos (<s> before each later
    [INST]), -sys-strip (every content trimmed)."""

    def render(turns: list[Turn], add_ass: bool) -> str:
        out, inside = ["[INST] "], True
        for role, raw in turns:
            content = trim(raw) if strip else raw
            if not inside:
                inside = True
                out.append("<s>[INST] " if bos_inside else "[INST] ")
            if role == "system":
                out.append(f"<<SYS>>\n{content}\n<</SYS>>\n\n" if system else content + "\n")
            elif role == "user":
                out.append(content + " [/INST]")
            else:
                out.append(content + "</s>")
                inside = False
        return "".join(out)

    return render


# -- one header per turn -------------------------------------------------------------------------


def _headed(head: Callable[[str], str], tail: str, gen: str, trimmed: bool = False, start: str = "") -> Format:
    """Formats that write `start`, head(role) + content + tail per turn, and `gen` to open the
    answer."""

    def render(turns: list[Turn], add_ass: bool) -> str:
        out = [start] + [head(role) + (trim(content) if trimmed else content) + tail for role, content in turns]
        if add_ass:
            out.append(gen)
        return "".join(out)

    return render


def _granite4(turns: list[Turn], add_ass: bool) -> str:
    out = []
    for role, content in turns:
        if role == "assistant_tool_call":
            out.append("<|start_of_role|>assistant<|end_of_role|><|tool_call|>")
        else:
            out.append(f"<|start_of_role|>{role}<|end_of_role|>")
        out.append(content + "<|end_of_text|>\n")
    if add_ass:
        out.append("<|start_of_role|>assistant<|end_of_role|>")
    return "".join(out)


def _granite3(turns: list[Turn], add_ass: bool) -> str:
    out = []
    for role, content in turns:
        out.append(f"<|start_of_role|>{role}<|end_of_role|>")
        if role == "assistant_tool_call":
            out.append("<|tool_call|>")
        out.append(content + "<|end_of_text|>\n")
    if add_ass:
        out.append("<|start_of_role|>assistant<|end_of_role|>")
    return "".join(out)


def _monarch(turns: list[Turn], add_ass: bool) -> str:
    out = [("" if i == 0 else "<s>") + f"{role}\n{content}</s>\n" for i, (role, content) in enumerate(turns)]
    if add_ass:
        out.append("<s>assistant\n")
    return "".join(out)


def _seed_oss(turns: list[Turn], add_ass: bool) -> str:
    out = [
        f"<seed:bos>{role}\n{trim(content) if role == 'assistant' else content}<seed:eos>" for role, content in turns
    ]
    if add_ass:
        out.append("<seed:bos>assistant\n")
    return "".join(out)


def _gpt_oss(turns: list[Turn], add_ass: bool) -> str:
    out = [
        f"<|start|>{role}<|message|>{content}" + ("<|return|>" if role == "assistant" else "<|end|>")
        for role, content in turns
    ]
    if add_ass:
        out.append("<|start|>assistant")
    return "".join(out)


def _bailing(think: bool) -> Format:
    def render(turns: list[Turn], add_ass: bool) -> str:
        out = [f"<role>{'HUMAN' if role == 'user' else _upper(role)}</role>{content}" for role, content in turns]
        if add_ass:
            out.append("<role>ASSISTANT</role><think>" if think else "<role>ASSISTANT</role>")
        return "".join(out)

    return render


def _bailing2(turns: list[Turn], add_ass: bool) -> str:
    out = [] if turns and turns[0][0] == "system" else ["<role>SYSTEM</role>detailed thinking off<|role_end|>"]
    out += [
        f"<role>{'HUMAN' if role == 'user' else _upper(role)}</role>{content}<|role_end|>" for role, content in turns
    ]
    if add_ass:
        out.append("<role>ASSISTANT</role>")
    return "".join(out)


# -- formats that merge, rename or drop roles ----------------------------------------------------


def _gemma(turns: list[Turn], add_ass: bool) -> str:
    out, system = [], ""
    for role, content in turns:
        if role == "system":  # no system turn in gemma: merged into the next user turn
            system += trim(content)
            continue
        role = "model" if role == "assistant" else role
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(trim(content) + "<end_of_turn>\n")
    if add_ass:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _orion(turns: list[Turn], add_ass: bool) -> str:
    out, system = [], ""
    for role, content in turns:
        if role == "system":  # merged into the next user turn
            system += content
        elif role == "user":
            out.append("Human: ")
            if system:
                out.append(system + "\n\n")
                system = ""
            out.append(content + "\n\nAssistant: </s>")
        else:
            out.append(content + "</s>")
    return "".join(out)


def _openchat(turns: list[Turn], add_ass: bool) -> str:
    out = []
    for role, content in turns:
        if role == "system":
            out.append(content + "<|end_of_turn|>")
        else:
            out.append(f"GPT4 Correct {_upper(role[:1]) + role[1:]}: {content}<|end_of_turn|>")
    if add_ass:
        out.append("GPT4 Correct Assistant:")
    return "".join(out)


def _vicuna(orca: bool) -> Format:
    def render(turns: list[Turn], add_ass: bool) -> str:
        out = []
        for role, content in turns:
            if role == "system":
                out.append(f"SYSTEM: {content}\n" if orca else content + "\n\n")
            elif role == "user":
                out.append(f"USER: {content}\n")
            elif role == "assistant":
                out.append(f"ASSISTANT: {content}</s>\n")
        if add_ass:
            out.append("ASSISTANT:")
        return "".join(out)

    return render


def _by_role(parts: dict[str, tuple[str, str]], gen: str, trimmed: bool = False) -> Format:
    """Formats with a (prefix, suffix) per known role; other roles are dropped."""

    def render(turns: list[Turn], add_ass: bool) -> str:
        out = []
        for role, content in turns:
            if role in parts:
                pre, post = parts[role]
                out.append(pre + (trim(content) if trimmed else content) + post)
        if add_ass:
            out.append(gen)
        return "".join(out)

    return render


def _minicpm(turns: list[Turn], add_ass: bool) -> str:
    return "".join(f"<用户>{trim(c)}<AI>" if role == "user" else trim(c) for role, c in turns)


def _rwkv_world(turns: list[Turn], add_ass: bool) -> str:
    out = []
    for i, (role, content) in enumerate(turns):
        if role == "system":
            out.append(f"System: {trim(content)}\n\n")
        elif role == "user":
            out.append(f"User: {trim(content)}\n\n")
            if i == len(turns) - 1:  # the answer opens after a final user turn, whatever add_ass says
                out.append("Assistant:")
        elif role == "assistant":
            out.append(f"Assistant: {trim(content)}\n\n")
    return "".join(out)


def _gigachat(turns: list[Turn], add_ass: bool) -> str:
    has_system = bool(turns) and turns[0][0] == "system"
    out = [f"<s>{turns[0][1]}<|message_sep|>" if has_system else "<s>"]
    for role, content in turns[1 if has_system else 0 :]:
        if role == "user":
            out.append(f"user<|role_sep|>{content}<|message_sep|>available functions<|role_sep|>[]<|message_sep|>")
        elif role == "assistant":
            out.append(f"assistant<|role_sep|>{content}<|message_sep|>")
    if add_ass:
        out.append("assistant<|role_sep|>")
    return "".join(out)


def _hunyuan_moe(turns: list[Turn], add_ass: bool) -> str:
    out = []
    for role, content in turns:
        if role == "system":
            out.append(f"<|startoftext|>{content}<|extra_4|>")
        elif role == "assistant":
            out.append(content + "<|eos|>")
        else:
            out.append(f"<|startoftext|>{content}<|extra_0|>")
    return "".join(out)


def _hunyuan_dense(turns: list[Turn], add_ass: bool) -> str:
    out = []
    for i, (role, content) in enumerate(turns):
        if i == 0 and role == "system":
            out.append(content + HY_HOLDER_3)
        if role == "assistant":
            out.append(HY_ASSISTANT + content + HY_HOLDER_2)
        elif role == "user":
            out.append(HY_USER + content + HY_ASSISTANT)
    return "".join(out)


def _hunyuan_vl(turns: list[Turn], add_ass: bool) -> str:
    out = [HY_BOS]
    for i, (role, content) in enumerate(turns):
        if i == 0 and role == "system":
            out.append(content + HY_HOLDER_3)
        elif role == "user":
            out.append(content + HY_USER)
        elif role == "assistant":
            out.append(content + HY_ASSISTANT)
    return "".join(out)


def _pangu_embedded(turns: list[Turn], add_ass: bool) -> str:
    names = {"system": "系统", "user": "用户", "assistant": "助手", "tool": "工具", "function": "方法"}
    out = []
    for i, (role, content) in enumerate(turns):
        if i == 0 and role != "system":
            out.append("[unused9]系统：[unused10]")
        if role in names:
            out.append(f"[unused9]{names[role]}：{content}[unused10]")
    if add_ass:
        out.append("[unused9]助手：")
    return "".join(out)


def _grok2(turns: list[Turn], add_ass: bool) -> str:
    out = []
    for role, content in turns:
        if role == "system":
            out.append(f"System: {trim(content)}<|separator|>\n\n")
        elif role == "user":
            out.append(f"Human: {trim(content)}<|separator|>\n\n")
        elif role == "assistant":  # not trimmed, unlike the others
            out.append(f"Assistant: {content}<|separator|>\n\n")
    if add_ass:
        out.append("Assistant:")
    return "".join(out)


def _dots1(turns: list[Turn], add_ass: bool) -> str:
    parts = {"system": ("<|system|>", "<|endofsystem|>"), "user": ("<|userprompt|>", "<|endofuserprompt|>")}
    out = []
    for role, content in turns:
        pre, post = parts.get(role, ("<|response|>", "<|endofresponse|>"))
        out.append(pre + content + post)
    if add_ass:
        out.append("<|response|>")
    return "".join(out)


def _deepseek_ocr(turns: list[Turn], add_ass: bool) -> str:
    return "".join(content for _, content in turns)  # no template


def _yandex(turns: list[Turn], add_ass: bool) -> str:
    names = {"user": " Пользователь: ", "assistant": " Ассистент: "}
    out = [names[role] + content + "\n\n" for role, content in turns if role in names]
    if add_ass:
        out.append(" Ассистент:[SEP]")
    return "".join(out)


_EXAONE = {"system": ("[|system|]", "[|endofturn|]\n"), "user": ("[|user|]", "\n")}
_EXAONE["assistant"] = ("[|assistant|]", "[|endofturn|]\n")

# llama.cpp's LLM_CHAT_TEMPLATES, in its order: the names --chat-template accepts
NAMED: dict[str, Format] = {
    "chatml": _chatml,
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(" ", " ", trim_assistant=False),
    "mistral-v3": _mistral("", " ", trim_assistant=True),
    "mistral-v3-tekken": _mistral("", "", trim_assistant=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _headed(lambda r: f"<|{r}|>\n", "<|end|>\n", "<|assistant|>\n"),
    "phi4": _phi4,
    "falcon3": _headed(lambda r: f"<|{r}|>\n", "\n", "<|assistant|>\n"),
    "zephyr": _headed(lambda r: f"<|{r}|>\n", "<|endoftext|>\n", "<|assistant|>\n"),
    "monarch": _monarch,
    "gemma": _gemma,
    "orion": _orion,
    "openchat": _openchat,
    "vicuna": _vicuna(orca=False),
    "vicuna-orca": _vicuna(orca=True),
    "deepseek": _by_role(
        {"system": ("", ""), "user": ("### Instruction:\n", "\n"), "assistant": ("### Response:\n", "\n<|EOT|>\n")},
        "### Response:\n",
    ),
    "deepseek2": _by_role(
        {"system": ("", "\n\n"), "user": ("User: ", "\n\n"), "assistant": ("Assistant: ", DS_EOS)}, "Assistant:"
    ),
    "deepseek3": _by_role(
        {"system": ("", "\n\n"), "user": (DS_USER, ""), "assistant": (DS_ASSISTANT, DS_EOS)}, DS_ASSISTANT
    ),
    "deepseek-ocr": _deepseek_ocr,
    "command-r": _by_role(
        {
            "system": ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
            "user": ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
            "assistant": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        },
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        trimmed=True,
    ),
    "llama3": _headed(
        lambda r: f"<|start_header_id|>{r}<|end_header_id|>\n\n",
        "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        trimmed=True,
    ),
    "chatglm3": _headed(lambda r: f"<|{r}|>\n ", "", "<|assistant|>", start="[gMASK]sop"),
    "chatglm4": _headed(lambda r: f"<|{r}|>\n", "", "<|assistant|>\n", start="[gMASK]<sop>"),
    "glmedge": _headed(lambda r: f"<|{r}|>\n", "", "<|assistant|>"),
    "minicpm": _minicpm,
    "exaone3": _by_role(_EXAONE, "[|assistant|]", trimmed=True),
    "exaone4": _by_role({**_EXAONE, "tool": ("[|tool|]", "[|endofturn|]\n")}, "[|assistant|]", trimmed=True),
    "exaone-moe": _by_role(
        {r: (f"<|{r}|>\n", "<|endofturn|>\n") for r in ("system", "user", "assistant", "tool")},
        "<|assistant|>\n",
        trimmed=True,
    ),
    "rwkv-world": _rwkv_world,
    "granite": _granite3,
    "granite-4.0": _granite4,
    "granite-4.1": _granite4,
    "gigachat": _gigachat,
    "megrez": _headed(
        lambda r: f"<|role_start|>{r}<|role_end|>", "<|turn_end|>", "<|role_start|>assistant<|role_end|>"
    ),
    "yandex": _yandex,
    "bailing": _bailing(think=False),
    "bailing-think": _bailing(think=True),
    "bailing2": _bailing2,
    "llama4": _headed(
        lambda r: f"<|header_start|>{r}<|header_end|>\n\n",
        "<|eot|>",
        "<|header_start|>assistant<|header_end|>\n\n",
        trimmed=True,
    ),
    "smolvlm": _smolvlm,
    "hunyuan-moe": _hunyuan_moe,
    "gpt-oss": _gpt_oss,
    "hunyuan-dense": _hunyuan_dense,
    "hunyuan-vl": _hunyuan_vl,
    "kimi-k2": _kimi_k2,
    "seed_oss": _seed_oss,
    "grok-2": _grok2,
    "pangu-embedded": _pangu_embedded,
    "solar-open": _headed(lambda r: f"<|begin|>{r}<|content|>", "<|end|>", "<|begin|>assistant"),
}

# every format llama.cpp writes: the named ones, and dots1, which its detection returns for a
# dots.llm1 template but which has no name of its own (--chat-template dots1 is not accepted)
BUILTIN: dict[str, Format] = {**NAMED, "dots1": _dots1}
