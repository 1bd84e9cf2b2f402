"""llama-cli / llama-completion habits on the default model, through the real CLI: -r stops at a
reverse prompt and shows it, -i / -if read what you type (between --in-prefix and --in-suffix)
and continue, -e escapes, -sysf, --color, -l logit biases, -j constrains the output,
-sp shows control tokens. Greedy, so every expectation is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_inproc import Ran, run_cli

from ubatch.engine.generation.generation import Generation, GenerationParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams

GREEDY = ["--temp", "0", "--log-disable", "--no-warmup", "-t", "2"]
COUNT = "Count: 1, 2, 3,"


def run(model: Path, args: list[str], stdin: str = "") -> Ran:
    """`ubatch cli` through the real CLI in this process (tests/cli_inproc.py), LLAMA_* cleared:
    a fresh process would pay seconds for importing torch on top of the model's own work."""
    return run_cli(["cli", "-m", str(model), *GREEDY, *args], stdin=stdin)


@pytest.fixture(scope="module")
def runs(
    default_model_path: Path, default_model, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Ran]:  # type: ignore[no-untyped-def]
    space = default_model.vocab.tokenize(" 4", add_special=False, parse_special=False)[0]
    sysf = tmp_path_factory.mktemp("habits") / "system.txt"
    sysf.write_text("You are a terse pirate.\n")
    schema = json.dumps(
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    )
    cases: dict[str, tuple[list[str], str]] = {
        "reverse": (["-p", COUNT, "-n", "30", "-r", "6,"], ""),
        "interactive": (
            ["-i", "-p", COUNT, "-n", "12", "-r", "6,", "--in-prefix", " ", "--in-suffix", "10,"],
            " 7, 8, 9,\n",
        ),
        "first": (["-if", "-n", "6"], "The capital of France is\n"),
        "oneshot_nl": (["-p", "The capital of France is\\n", "-n", "6"], ""),
        "sysf": (["-sysf", str(sysf), "-p", "Hi", "-st", "-n", "4", "--simple-io", "-v"], ""),
        "bias": (["-p", COUNT, "-n", "2", "-l", f"{space}-inf"], ""),  # the greedy " " of " 4," banned
        "schema": (["-p", "The capital of France as JSON:", "-n", "40", "-j", schema], ""),
    }
    done = {name: run(default_model_path, *case) for name, case in cases.items()}
    done["escape"] = run(tiny_llama, ["-p", "a\\tb", "-n", "1"])  # quick ones on the tiny model
    done["no_escape"] = run(tiny_llama, ["-p", "a\\tb", "-n", "1", "--no-escape"])
    done["color"] = run(tiny_llama, ["-p", COUNT, "-n", "2", "--color", "on"])
    for k, r in done.items():
        assert r.returncode == 0, (k, r.stderr)
    return done


def test_reverse_prompt_stops_and_is_shown(runs: dict[str, Ran]) -> None:
    assert runs["reverse"].stdout == COUNT + " 4, 5, 6,\n"  # (-i below shows it would go on)


def test_interactive_reads_input_and_continues(runs: dict[str, Ran]) -> None:
    out = runs["interactive"].stdout
    # stopped at "6,"; then --in-prefix " ", the typed " 7, 8, 9,\n" (echoed by a terminal, not by
    # us), --in-suffix "10,", and the model goes on from there
    assert out.startswith(COUNT + " 4, 5, 6, 10, 11, 12,")


def test_interactive_first_equals_the_one_shot(runs: dict[str, Ran]) -> None:
    """-if with 'The capital of France is\\n' typed continues as -p with that text does."""
    first, once = runs["first"].stdout, runs["oneshot_nl"].stdout
    assert once.startswith("The capital of France is\n")
    assert first.strip() and first.strip() == once[len("The capital of France is\n") :].strip()


def test_escapes_system_prompt_file_and_colour(runs: dict[str, Ran]) -> None:
    assert runs["escape"].stdout.startswith("a\tb") and runs["no_escape"].stdout.startswith("a\\tb")
    assert runs["color"].stdout.startswith(f"\x1b[33m{COUNT}\x1b[0m")
    assert "You are a terse pirate." in runs["sysf"].stderr  # -v logs the formatted turn


def test_json_schema_constrains_the_output(runs: dict[str, Ran]) -> None:
    out = json.loads(runs["schema"].stdout.removeprefix("The capital of France as JSON:"))
    assert set(out) == {"city"} and len(out["city"]) <= 12


def test_logit_bias_bans_the_greedy_token(runs: dict[str, Ran]) -> None:
    out = runs["bias"].stdout
    assert out.startswith(COUNT) and not out.startswith(COUNT + " 4")  # greedy: " 4" (" " then "4")


def test_special_shows_control_tokens(default_model) -> None:  # type: ignore[no-untyped-def]
    v = default_model.vocab
    tok = v.tokenize("<start_of_turn>", add_special=False, parse_special=True)[0]
    logits = torch.full((v.n_tokens,), -1e9)
    logits[tok] = 0.0
    texts = []
    for special in (False, True):
        gen = Generation(v, Sampler(SamplerParams(temp=0)), GenerationParams(special=special), 64)
        texts.append(gen.sample(logits).text + gen.finish())
    assert texts == ["", "<start_of_turn>"]
