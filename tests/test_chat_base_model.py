"""The chat says when the model looks like a base model (issue 33).

The bundled Gemma 3 270M is a base model: asked a question in the chat, it continues the text,
repeats the question and never ends its turn. Nothing on screen said why; now the startup panel
(or a plain line with --simple-io / --verbose) does, from the GGUF's metadata: no chat template
and no instruction-tuning mark in the name, fine-tune, tags or file name.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from ubatch.engine.completion.conversation import looks_like_base_model

GEMMA_270M = {  # the bundled model's general.* keys, as its GGUF has them
    "general.architecture": "gemma3",
    "general.name": "Gemma 3 270m",
    "general.basename": "gemma-3",
    "general.size_label": "270M",
    "general.tags": ["gemma3", "gemma", "google", "text-generation"],
}
TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.parametrize(
    ("metadata", "filename", "base"),
    [
        (GEMMA_270M, "gemma-3-270m-q4_k_m.gguf", True),
        ({**GEMMA_270M, "tokenizer.chat_template": TEMPLATE}, "gemma-3-270m-q4_k_m.gguf", False),
        ({**GEMMA_270M, "general.finetune": "it"}, "model.gguf", False),
        (GEMMA_270M, "gemma-3-270m-it-Q4_K_M.gguf", False),
        ({"general.name": "Qwen2.5 0.5B Instruct"}, "model.gguf", False),
        ({"general.name": "TinyLlama 1.1B"}, "tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf", False),
        ({"general.tags": ["text-generation", "sft"]}, "model.gguf", False),
        ({"general.name": "Granite 3 2B"}, "granite-3-2b.gguf", True),  # "it" only as a word
        ({}, "tiny-gemma3.gguf", True),
        ({"tokenizer.chat_template": "  "}, "m.gguf", True),  # an empty template is none
    ],
)
def test_looks_like_base_model(metadata: dict[str, object], filename: str, base: bool) -> None:
    assert looks_like_base_model(metadata, filename) is base


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny gemma with a chat template in its GGUF."""
    from tiny_models import TinySpec, write_tiny_model

    def extra(w: gguf.GGUFWriter, rng: np.random.Generator) -> None:
        w.add_chat_template(TEMPLATE)

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-gemma3.gguf", TinySpec(extra=extra))


def flat(text: str) -> str:
    """Panel text as one line: borders dropped, wrapped lines joined."""
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", text))


def test_the_panel_says_base_model_only_for_a_base_model(tiny_gemma: Path, tiny_chat_model: Path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from test_chat import PROMPT, Term, clean

    from ubatch.cli.complete.chat import BASE_MODEL_NOTE

    common = ["-c", "256", "--temp", "0", "-n", "4"]
    base = Term(["-m", str(tiny_gemma), *common], tmp_path / "a")
    chat = Term(["-m", str(tiny_chat_model), *common], tmp_path / "b")
    try:
        for t in (base, chat):
            t.expect(PROMPT)
            t.child.sendeof()
            t.expect(r"Exiting\.\.\.")
            assert t.finish() == 0
        panel_base, panel_chat = flat(clean(base.raw)), flat(clean(chat.raw))
        assert f"note {BASE_MODEL_NOTE}" in panel_base
        assert "template gemma (built-in; no template in the GGUF" in panel_base
        assert "base model" not in panel_chat and "GGUF tokenizer.chat_template" in panel_chat
    finally:
        for t in (base, chat):
            if not t.child.closed:
                t.child.close(force=True)


@pytest.mark.parametrize(("flag", "line"), [("--simple-io", "note         "), ("--verbose", "note: ")])
def test_plain_line_with_simple_io_or_verbose(tiny_gemma: Path, flag: str, line: str) -> None:
    from test_chat import run_cli

    from ubatch.cli.complete.chat import BASE_MODEL_NOTE

    r = run_cli("-m", tiny_gemma, "-c", 256, "-n", 2, "--temp", 0, flag, stdin="hi\n")
    assert r.returncode == 0, r.stderr
    assert f"\n{line}{BASE_MODEL_NOTE}\n" in r.stderr
