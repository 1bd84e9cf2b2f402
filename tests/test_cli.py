"""The `ubatch` command line: the real Typer app, mostly run in this process (tests/cli_inproc.py),
since each fresh process pays seconds for importing torch against milliseconds of work on the tiny
model. One run with the bundled default model and the console script still start real processes,
so a fresh interpreter is covered too. Module fixtures run the commands once; the tests then check
their results one by one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_inproc import Ran, run_cli

from ubatch.kernels.cpu.build import FAST_FLAGS, cpu_flags, load

REFDATA = Path(__file__).parent / "refdata"
PROMPT = "The capital of France is"
GREEDY8 = " the capital of the country of France."  # llama.cpp's greedy continuation, 8 tokens

Run = subprocess.CompletedProcess


def ubatch(*args: object, stdin: str | None = None, timeout: float = 300) -> Run:
    env = dict(os.environ, COLUMNS="300", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "ubatch.cli.main", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def ubatch_inproc(cmds: dict[str, Sequence[object] | tuple[Sequence[object], str]]) -> dict[str, Ran]:
    """Several commands through the real CLI in this process (tests/cli_inproc.py), one after
    another: {name: args} or {name: (args, stdin)}."""
    out = {}
    for name, spec in cmds.items():
        args, stdin = spec if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], str) else (spec, "")
        out[name] = run_cli([str(a) for a in args], {"COLUMNS": "300"}, stdin)  # type: ignore[union-attr]
    return out


def lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def assert_user_error(r: Run | Ran, *needles: str) -> str:
    """Exit 1, nothing on stdout, one non-empty stderr line naming the problem, no traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    err = lines(r.stderr)
    assert len(err) == 1, r.stderr
    assert err[0].startswith("error: ")
    for n in needles:
        assert n.lower() in err[0].lower(), (n, err[0])
    assert r.stdout == ""
    return err[0]


# -- the default model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_runs(default_model_path: Path) -> dict[str, Run | Ran]:
    refs = [json.loads(x) for x in (REFDATA / "tokenize.jsonl").read_text().splitlines()]
    texts = [r["text"] for r in refs] + ["x<end_of_turn>y"]
    jsonl = "".join(json.dumps(t) + "\n" for t in texts)
    m = ["-m", default_model_path]
    with ThreadPoolExecutor(1) as pool:
        # no -m: the bundled default model, in a real process while the tokenizer runs here
        greedy = pool.submit(ubatch, "cli", "-p", PROMPT, "-n", 8, "--temp", 0, "-c", 512)
        runs: dict[str, Run | Ran] = dict(
            ubatch_inproc(
                {
                    "ids": ["tokenize", *m, "-p", "Hello world", "--ids"],
                    "list": ["tokenize", *m, "-p", "Hello world", "--show-count"],
                    "jsonl": (["tokenize", *m, "--jsonl"], jsonl),
                    "jsonl_plain": (["tokenize", *m, "--jsonl", "--no-parse-special"], jsonl),
                    "jsonl_nobos": (["tokenize", *m, "--jsonl", "--no-parse-special", "--no-bos"], jsonl),
                }
            )
        )
        runs["greedy"] = greedy.result()
    return runs


@pytest.mark.slow
def test_cli_greedy_default_model(default_runs: dict[str, Run | Ran]) -> None:
    r = default_runs["greedy"]
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPT + GREEDY8 + "\n"
    err = r.stderr
    assert "Traceback" not in err
    for needle in (
        "llama_context: n_ctx                 = 512",
        "llama_context: n_batch               = 512",
        "llama_context: n_ubatch              = 512",
        "llama_kv_cache: size =",
        "llama_kv_cache_iswa: creating non-SWA KV cache, size = 512 cells",
        "common_perf_print: prompt eval time =",
        "common_perf_print:        eval time =",
        "common_perf_print:    graphs reused =",
        "common_perf_print:        load time =",
    ):
        assert needle in err, needle
    by_key = {x.split("=")[0].strip(): x for x in err.splitlines() if "=" in x}
    assert "/     6 tokens" in by_key["common_perf_print: prompt eval time"]
    assert "/     7 runs" in by_key["common_perf_print:        eval time"]
    assert "/    14 tokens" in by_key["common_perf_print:       total time"]
    # Gemma 3 270M: 3 global layers x 512 cells x 256 x f16 for K and for V = 0.75 MiB each
    assert "llama_kv_cache: size =    1.50 MiB (   512 cells,   3 layers" in err


@pytest.mark.slow
def test_tokenize_ids(default_runs: dict[str, Run | Ran]) -> None:
    r = default_runs["ids"]
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[2, 9259, 1902]\n"


@pytest.mark.slow
def test_tokenize_listing_and_count(default_runs: dict[str, Run | Ran]) -> None:
    r = default_runs["list"]
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("     2 -> '<bos>'\n  9259 -> 'Hello'\n  1902 -> ' world'\nTotal number of tokens: 3\n")


@pytest.mark.slow
@pytest.mark.parametrize(
    "run, key", [("jsonl", "ids_special"), ("jsonl_plain", "ids_plain"), ("jsonl_nobos", "ids_nobos")]
)
def test_tokenize_jsonl_matches_llama_cpp(default_runs: dict[str, Run | Ran], run: str, key: str) -> None:
    r = default_runs[run]
    assert r.returncode == 0, r.stderr
    refs = [json.loads(x) for x in (REFDATA / "tokenize.jsonl").read_text().splitlines()]
    out = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(out) == len(refs) + 1
    for ref, got in zip(refs, out):
        assert got == ref[key], ref["text"]
    eot = 106  # <end_of_turn>
    if run == "jsonl":
        assert out[-1] == [2, 236781, eot, 236762]  # x <end_of_turn> y
    else:
        assert eot not in out[-1] and len(out[-1]) > 4  # the text of the tag, tokenized
        assert (out[-1][0] == 2) == (run == "jsonl_plain")


# -- tiny model: output options, sampling, batching -----------------------------------------------


@pytest.fixture(scope="module")
def tiny_runs(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    d = tmp_path_factory.mktemp("cli")
    (d / "prompt.txt").write_text("Hello world\n")  # llama.cpp drops one trailing newline
    m = ["-m", tiny_gemma]
    base = ["cli", *m, "-c", 256]
    hot = ["--temp", 50, "--top-k", 0, "--top-p", 1, "--min-p", 0, "-n", 24]  # nearly uniform
    # where one run can check several things it does (the batch clamps are read from the logs of
    # the EOS runs, --backend cpu from "plain")
    return ubatch_inproc(
        {
            "plain": [*base, "-p", "Hello world", "-n", 4, "--temp", 0, "--backend", "cpu"],
            "no_prompt": [*base, "-p", "Hello world", "-n", 4, "--temp", 0, "--log-disable", "--no-display-prompt"],
            "file": [*base, "-f", d / "prompt.txt", "-n", 4, "--temp", 0, "--log-disable"],
            "hot42_a": [*base, "-p", "Hello world", *hot, "--seed", 42],
            "hot42_b": [*base, "-p", "Hello world", *hot, "--seed", 42, "--log-disable"],
            "hot43": [*base, "-p", "Hello world", *hot, "--seed", 43, "--log-disable"],
            "escapes": [*base, "-p", r"a\tb\\n\x41 C:\q \x4", "-n", 0, "--log-disable"],
            "no_escape": [*base, "-p", r"a\tb\x41", "-n", 0, "--log-disable", "--no-escape"],
            "eos": ["cli", *m, "-p", "Hello<eos>", "-n", 5, "--temp", 0, "-c", 64, "-b", 128, "-ub", 256],
            "ignore_eos": [
                "cli",
                *m,
                "-p",
                "Hello<eos>",
                "-n",
                5,
                "--temp",
                0,
                "--ignore-eos",
                "-c",
                300,
                "-b",
                1024,
                "-ub",
                64,
            ],
            "torch": [*base, "-p", "Hello world", "-n", 4, "--temp", 0, "--backend", "torch"],
            "avx2": [*base, "-p", "Hello world", "-n", 4, "--temp", 0, "--backend", "cpu-avx2"],
            # a prompt past AMX_MIN_ROWS: prefill's GEMM on AMX tiles where the CPU has them
            **{
                f"long_{b}": [*base, "-p", "Hello world " * 30, "-n", 4, "--temp", 0, "--backend", b]
                for b in ("cpu", "cpu-noamx", "torch")
            },
            "info_cpu": ["info", *m, "-c", 256, "--json"],
            "info_torch": ["info", *m, "-c", 256, "--json", "--backend", "torch"],
            "bad_backend": [*base, "-p", "Hello world", "-n", 1, "--backend", "gpu9"],
            "help": ["cli", "--help"],
        }
    )


def test_cli_prompt_then_continuation(tiny_runs: dict[str, Ran]) -> None:
    r = tiny_runs["plain"]
    assert r.returncode == 0, r.stderr
    # the tiny model's tied embeddings make it repeat the last token
    assert r.stdout == "Hello world world world world world\n"
    assert "llama_context: n_ctx                 = 256" in r.stderr
    assert "/     5 tokens" in r.stderr and "/     3 runs" in r.stderr


def test_cli_log_disable(tiny_runs: dict[str, Ran]) -> None:
    for name in ("file", "no_prompt", "hot42_b"):  # -f and -p, each with --log-disable
        assert tiny_runs[name].returncode == 0 and tiny_runs[name].stderr == "", name
    assert tiny_runs["file"].stdout == tiny_runs["plain"].stdout  # the same text as with the logs


def test_cli_no_display_prompt(tiny_runs: dict[str, Ran]) -> None:
    r = tiny_runs["no_prompt"]
    assert r.returncode == 0
    assert r.stdout == " world world world world\n"


def test_cli_prompt_file(tiny_runs: dict[str, Ran]) -> None:
    r = tiny_runs["file"]
    assert r.returncode == 0, r.stderr
    assert r.stdout == tiny_runs["plain"].stdout


def test_cli_seed_reproducible(tiny_runs: dict[str, Ran]) -> None:
    h1, h2, h3 = tiny_runs["hot42_a"], tiny_runs["hot42_b"], tiny_runs["hot43"]
    assert h1.returncode == h2.returncode == h3.returncode == 0
    assert "sampler seed: 42" in h1.stderr
    assert h1.stdout == h2.stdout  # the same seed, with and without the logs
    assert h1.stdout != h3.stdout  # 24 nearly uniform draws over 326 tokens
    assert len(set(h1.stdout[len("Hello world") :])) > 5  # really sampled, not greedy


def log_value(err: str, key: str) -> int:
    for x in err.splitlines():
        if x.startswith(f"llama_context: {key} ") and "=" in x:
            return int(x.split("=")[1])
    raise AssertionError(f"no {key} line in:\n{err}")


def test_cli_batch_clamps(tiny_runs: dict[str, Ran]) -> None:
    r = tiny_runs["eos"]  # -c 64 -b 128 -ub 256
    assert r.returncode == 0, r.stderr
    assert log_value(r.stderr, "n_ctx") == 256  # padded to a multiple of 256
    assert log_value(r.stderr, "n_batch") == 64  # n_batch <= n_ctx (as requested, before padding)
    assert log_value(r.stderr, "n_ubatch") == 64  # n_ubatch <= n_batch
    r = tiny_runs["ignore_eos"]  # -c 300 -b 1024 -ub 64
    assert r.returncode == 0, r.stderr
    assert log_value(r.stderr, "n_ctx") == 512
    assert log_value(r.stderr, "n_batch") == 300
    assert log_value(r.stderr, "n_ubatch") == 64


def test_cli_escapes_like_llama_cpp(tiny_runs: dict[str, Ran]) -> None:
    r = tiny_runs["escapes"]
    assert r.returncode == 0, r.stderr
    # \t -> tab, \\ -> \, \x41 -> A; unknown (\q) and incomplete (\x4) escapes are kept
    assert r.stdout == "a\tb\\nA C:\\q \\x4\n"
    r = tiny_runs["no_escape"]
    assert r.returncode == 0, r.stderr
    assert r.stdout == "a\\tb\\x41\n"


def test_cli_stops_at_eos_unless_ignored(tiny_runs: dict[str, Ran]) -> None:
    r = tiny_runs["eos"]  # the tiny model repeats its last token: here <eos>, so it stops at once
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hello<eos>\n"
    r = tiny_runs["ignore_eos"]  # --ignore-eos bans end-of-generation tokens (logit bias -inf)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello<eos>") and len(r.stdout) > len("Hello<eos>\n")
    assert "/     4 runs" in r.stderr  # 5 tokens sampled, 4 decoded


def test_cli_help(tiny_runs: dict[str, Ran]) -> None:
    r = tiny_runs["help"]
    assert r.returncode == 0
    for opt in ("--ctx-size", "--batch-size", "--ubatch-size", "--temp", "--seed", "--log-disable"):
        assert opt in r.stdout


def test_console_script_exists() -> None:
    exe = Path(sys.executable).parent / "ubatch"
    if not exe.exists():
        pytest.skip("no console script next to the interpreter")
    r = subprocess.run([str(exe), "tokenize", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--jsonl" in r.stdout


# -- bad input: one line on stderr, exit 1, no traceback ------------------------------------------


def write_gguf_arch(path: Path, arch: str) -> Path:
    from tiny_vocab import add_spm_vocab, tiny_spm_vocab

    tokens, scores, types = tiny_spm_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    add_spm_vocab(w, tokens, scores, types)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_with_unsupported_type(path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import tiny_models
    from gguf import GGMLQuantizationType as T

    from ubatch.kernels.quant.dequant import SUPPORTED_TYPES

    assert int(T.NVFP4) not in SUPPORTED_TYPES
    orig = tiny_models._tensor

    def tensor(w: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: int, rng: np.random.Generator) -> None:
        if name != "blk.1.ffn_up.weight":
            return orig(w, name, arr, qtype, rng)
        block, size = gguf.GGML_QUANT_SIZES[T.NVFP4]
        raw = np.zeros((arr.shape[0], arr.shape[1] // block * size), np.uint8)
        w.add_tensor(name, raw, raw_dtype=T.NVFP4)

    with monkeypatch.context() as mp:
        mp.setattr(tiny_models, "_tensor", tensor)
        return tiny_models.write_tiny_model(path)


@pytest.fixture(scope="module")
def bad_runs(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    d = tmp_path_factory.mktemp("bad")
    data = tiny_gemma.read_bytes()
    (d / "notes.txt").write_text("these are not the weights you are looking for\n")
    (d / "empty.gguf").write_bytes(b"")
    (d / "head.gguf").write_bytes(data[:300])  # cut inside the metadata
    (d / "tail.gguf").write_bytes(data[: len(data) - 4096])  # cut inside the tensor data
    write_gguf_arch(d / "mamba.gguf", "mamba")
    with pytest.MonkeyPatch.context() as mp:
        write_tiny_with_unsupported_type(d / "nvfp4.gguf", mp)
    (d / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    m = ["-m", tiny_gemma]
    return ubatch_inproc(
        {
            "missing": ["cli", "-m", d / "nope.gguf", "-p", "hi", "-n", 1],
            "directory": ["cli", "-m", d, "-p", "hi", "-n", 1],
            "not_gguf": ["cli", "-m", d / "notes.txt", "-p", "hi", "-n", 1],
            "empty": ["cli", "-m", d / "empty.gguf", "-p", "hi", "-n", 1],
            "cut_header": ["cli", "-m", d / "head.gguf", "-p", "hi", "-n", 1],
            "cut_data": ["cli", "-m", d / "tail.gguf", "-p", "hi", "-n", 1],
            "arch": ["cli", "-m", d / "mamba.gguf", "-p", "hi", "-n", 1],
            "qtype": ["cli", "-m", d / "nvfp4.gguf", "-p", "hi", "-n", 1],
            "too_long": ["cli", *m, "-c", 256, "-p", "hello " * 300],
            "prompt_missing": ["cli", *m, "-f", d / "nope.txt"],
            "prompt_dir": ["cli", *m, "-f", d],
            "prompt_bytes": ["cli", *m, "-f", d / "latin1.txt"],
            "prompt_not_utf8": ["cli", *m, "-p", "caf\udce9", "-n", 1],  # byte 0xE9 on the command line
            "kv_type": ["cli", *m, "-p", "hi", "-n", 1, "-ctk", "q7_x"],
            "negative_ctx": ["cli", *m, "-p", "hi", "-n", 1, "-c", -5],
            "tok_missing": ["tokenize", "-m", d / "nope.gguf", "-p", "hi"],
            "tok_cut": ["tokenize", "-m", d / "head.gguf", "-p", "hi"],
            "tok_nothing": ["tokenize", *m],
            "tok_file": ["tokenize", *m, "-f", d / "nope.txt"],
            "tok_bad_json": (["tokenize", *m, "--jsonl"], '"fine"\n{not json\n"never reached"\n'),
            "tok_not_string": (["tokenize", *m, "--jsonl"], '["a list"]\n'),
            "tok_surrogate": (["tokenize", *m, "--jsonl"], '"a\\ud800b"\n'),  # a lone surrogate
        }
    )


BAD = {
    "missing": ("nope.gguf", "no such file"),
    "directory": ("directory",),
    "not_gguf": ("notes.txt", "not a GGUF file"),
    "empty": ("empty.gguf", "not a GGUF file"),
    "cut_header": ("head.gguf", "truncated"),
    "cut_data": ("tail.gguf", "truncated", "tensor"),
    "arch": ("mamba.gguf", "architecture", "mamba"),
    "qtype": ("nvfp4.gguf", "NVFP4", "blk.1.ffn_up.weight", "not supported"),
    "too_long": ("303 tokens", "256", "-c"),
    "prompt_missing": ("nope.txt", "cannot read"),
    "prompt_dir": ("cannot read",),
    "prompt_bytes": ("latin1.txt", "UTF-8"),
    "prompt_not_utf8": ("prompt", "UTF-8"),
    "kv_type": ("q7_x", "KV cache type"),
    "negative_ctx": ("negative",),
    "tok_missing": ("nope.gguf", "no such file"),
    "tok_cut": ("head.gguf", "truncated"),
    "tok_nothing": ("-p",),
    "tok_file": ("nope.txt", "cannot read"),
    "tok_bad_json": ("line 2", "JSON"),
    "tok_not_string": ("line 1", "string"),
    "tok_surrogate": ("line 1", "UTF-8"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_error(bad_runs: dict[str, Ran], case: str) -> None:
    r = bad_runs[case]
    if case == "tok_bad_json":  # lines before the bad one were answered
        (first,) = r.stdout.splitlines()
        assert json.loads(first)[0] == 2
        r = Ran(r.returncode, "", r.stderr)
    assert_user_error(r, *BAD[case])


def test_too_long_prompt_fails_before_any_output(bad_runs: dict[str, Ran]) -> None:
    r = bad_runs["too_long"]
    assert r.stdout == ""  # the prompt is not echoed
    assert "llama_context" not in r.stderr  # nor is the model run (warm-up) or logged


def test_backend_flag_same_text_and_the_memory_each_holds(tiny_runs: dict[str, Ran]) -> None:
    """--backend through the real CLI: the same greedy text from the C kernels and the torch
    reference, each backend's weight memory in `info --json`, and a bad name as one line."""
    runs = dict(tiny_runs, cpu=tiny_runs["plain"], bad=tiny_runs["bad_backend"])
    assert runs["cpu"].returncode == 0 and runs["torch"].returncode == 0, runs["cpu"].stderr
    assert runs["cpu"].stdout == runs["torch"].stdout
    held = json.loads(runs["info_cpu"].stdout)["backend_bytes"] / 2**20  # the AVX2 Q5_0 repack, or 0
    assert f"ubatch: backend = cpu, weights held beyond the file = {held:.2f} MiB" in runs["cpu"].stderr
    assert "ubatch: backend = torch" in runs["torch"].stderr
    # the 256-bit kernels, even on an AVX-512 CPU: the same text, and the log names the build
    assert runs["avx2"].returncode == 0 and runs["avx2"].stdout == runs["torch"].stdout, runs["avx2"].stderr
    assert "ubatch: backend = cpu-avx2," in runs["avx2"].stderr
    if set(FAST_FLAGS) <= cpu_flags():
        assert "C avx2: fused dequant GEMV" in runs["avx2"].stderr
    # a long prompt: the same text with prefill on AMX tiles (where this CPU has them), on the f32
    # GEMM (cpu-noamx) and on the reference, and the log says which GEMM each used
    long = {b: runs[f"long_{b}"] for b in ("cpu", "cpu-noamx", "torch")}
    assert all(r.returncode == 0 for r in long.values()), long["cpu"].stderr
    assert long["cpu"].stdout == long["cpu-noamx"].stdout == long["torch"].stdout
    assert "ubatch: backend = cpu-noamx," in long["cpu-noamx"].stderr
    assert ("AMX tiles from 64 rows" in long["cpu"].stderr) == load().amx
    assert "AMX tiles" not in long["cpu-noamx"].stderr
    cpu, ref = json.loads(runs["info_cpu"].stdout), json.loads(runs["info_torch"].stdout)
    assert cpu["backend"] == "cpu"
    repacked = load().simd == "avx2"  # Q5_0 computed from Q8_0 blocks (kernels/repack.py)
    assert (cpu["backend_bytes"] > 0) == repacked == cpu["kernels"]["Q5_0"].startswith("repacked to Q8_0")
    assert ref["backend"] == "torch" and ref["backend_bytes"] > cpu["model_bytes"]  # dense f32
    assert all("GEMV (<= 16 rows)" in path for path in cpu["kernels"].values())
    vnni = load().simd == "avx512" and load().lib.ub_vnni() > 0  # the K-quants' integer GEMV (csrc/gemv_vnni.c)
    assert all(
        ("integer GEMV" in path) == (vnni and t in ("Q4_K", "Q5_K", "Q6_K")) for t, path in cpu["kernels"].items()
    )
    assert all(  # and their prefill GEMM on code panels (ub_gemm_vnni)
        ("x as 16 + 8-bit integers" in path) == (vnni and t in ("Q4_K", "Q5_K", "Q6_K"))
        for t, path in cpu["kernels"].items()
    )
    bad = runs["bad"]
    assert bad.returncode == 1 and "unknown backend 'gpu9'" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
