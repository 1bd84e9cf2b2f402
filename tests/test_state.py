"""Saved sequence state (engine/context/state.py, engine/context/state_file.py) through every door: the engine,
`Llama.save_state` / `load_state`, llama-completion's `--prompt-cache` (restored in a fresh process), and
llama-server's POST /slots/{id}?action=save|restore|erase over HTTP. A restored sequence must
continue exactly as the uninterrupted run; every bad state is refused in one line (or
llama-server's error JSON) before the cache changes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from cli_inproc import Ran, run_cli
from test_server import GREEDY, Live, start_server_engine

from ubatch import Llama
from ubatch.cli.server.app import ServerOptions, create_app
from ubatch.cli.server.routes.slots import valid_filename
from ubatch.engine.batch import Batch
from ubatch.engine.context import state, state_file
from ubatch.engine.context.context import Context
from ubatch.engine.context.state_file import StateError
from ubatch.engine.params import ContextParams
from ubatch.engine.serve.scheduler import Scheduler

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def ubatch_cli(*args: object) -> subprocess.CompletedProcess[str]:
    """`ubatch cli ARGS` in a fresh process: nothing of an earlier run is left in memory."""
    cmd = [sys.executable, "-m", "ubatch.cli.main", "cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)


def ubatch_cli_here(*args: object) -> Ran:
    """`ubatch cli ARGS` through the real CLI in this process (tests/cli_inproc.py), where a fresh
    process is not the point: starting one costs seconds of importing torch."""
    return run_cli(["cli", *map(str, args)])


def greedy(ctx: Context, n_past: int, logits: torch.Tensor, n: int, seq_id: int = 0) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        ctx.decode(Batch.from_tokens([out[-1]], n_past, seq_id))
        n_past, logits = n_past + 1, ctx.logits[-1]
    return out


@pytest.fixture(scope="module")
def tiny_state(tiny_llama_model) -> state_file.SeqState:  # type: ignore[no-untyped-def]
    """A state of the tiny llama model, for the "another model" cases."""
    ctx = Context(tiny_llama_model, ContextParams(n_ctx=256))
    ctx.prefill([1, 5, 6, 7])
    return state.capture(ctx, 0, [1, 5, 6, 7])


# -- the default model in fresh processes: llama-completion's --prompt-cache ---------------------


def test_prompt_cache_fresh_process_equals_uninterrupted_run(
    default_model_path: Path, tmp_path: Path, tiny_state: state_file.SeqState
) -> None:
    """Run 1 (in this process) processes a ~600-token prompt, saves the state and generates; run 2,
    a new process, restores the file instead of processing the prompt and must print the same tokens."""
    prompt = " ".join(f"Line {i}: the value {i * 7 % 13} follows." for i in range(55))
    cache = tmp_path / "prompt.state"
    args = ("-m", default_model_path, "-no-cnv", "-p", prompt, "-n", 12, "--temp", 0, "-c", 1024)
    args += ("--no-display-prompt", "--no-warmup", "--prompt-cache", cache)
    first = ubatch_cli_here(*args)
    assert first.returncode == 0, first.stderr
    assert "session file does not exist, will create." in first.stderr and cache.stat().st_size > 0
    n_prompt, prompt_ms = re.search(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens", first.stderr).group(2, 1)
    assert 550 <= int(n_prompt) <= 700
    second = ubatch_cli(*args)
    assert second.returncode == 0, second.stderr
    assert "session file has exact match for prompt!" in second.stderr
    restored = re.search(r"prompt cache: restored (\d+) tokens in ([\d.]+) ms", second.stderr)
    assert restored and int(restored.group(1)) == int(n_prompt) - 1  # the last token is evaluated again
    last_ms = re.search(r"prompt eval time =\s+([\d.]+) ms /\s+1 tokens", second.stderr)
    assert last_ms
    assert second.stdout == first.stdout and len(first.stdout.strip()) > 0
    print(
        f"\n[state] {n_prompt}-token prompt: processed in {float(prompt_ms):.0f} ms; restored in "
        f"{restored.group(2)} ms, then the last token re-evaluated in {last_ms.group(1)} ms"
    )
    # another model's state: one line, exit 1, before anything is generated
    other = tmp_path / "other.state"
    state_file.write_file(other, tiny_state)
    bad = ubatch_cli_here("-m", default_model_path, "-no-cnv", "-p", "hi", "-n", 2, "--prompt-cache", other)
    assert bad.returncode == 1 and bad.stdout == ""
    last = bad.stderr.strip().splitlines()[-1]
    assert "another model" in last and "Traceback" not in bad.stderr


def test_prompt_cache_reuses_the_matching_prefix(tiny_gemma: Path, tmp_path: Path) -> None:
    """A longer prompt keeps the saved prefix and processes only the rest; -ro leaves the file."""
    cache = tmp_path / "p.state"
    base = ("-m", tiny_gemma, "-no-cnv", "-n", 4, "--temp", 0, "-c", 256, "--no-warmup", "--prompt-cache", cache)
    assert ubatch_cli_here(*base, "-p", "hello world the hello world how").returncode == 0
    saved = cache.read_bytes()
    b = ubatch_cli_here(*base, "-p", "hello world the hello world how are you", "--prompt-cache-ro")
    assert b.returncode == 0, b.stderr
    kept = int(re.search(r"prompt cache: restored (\d+) tokens", b.stderr).group(1))
    n_b = int(re.search(r"prompt eval time =.*/\s+(\d+) tokens", b.stderr).group(1))
    assert cache.read_bytes() == saved  # read-only
    full = ubatch_cli_here(*base[:-2], "-p", "hello world the hello world how are you")
    n_full = int(re.search(r"prompt eval time =.*/\s+(\d+) tokens", full.stderr).group(1))
    assert kept > 0 and n_b == n_full - kept and b.stdout == full.stdout


# -- the engine: every refusal before the cache changes -------------------------------------------


def test_restore_refusals_leave_the_cache_alone(tiny_gemma_model, tmp_path: Path, tiny_state) -> None:  # type: ignore[no-untyped-def]
    ctx = Context(tiny_gemma_model, ContextParams(n_ctx=512, n_seq_max=2))  # a stream per sequence
    prompt = list(range(3, 43))
    ctx.prefill(prompt)
    good = state.capture(ctx, 0, prompt)
    data = state_file.to_bytes(good)
    target = Context(tiny_gemma_model, ContextParams(n_ctx=512))
    target.prefill([3, 4, 5], seq_id=0)

    def refused(st: state_file.SeqState, into: Context = target) -> str:
        before = (into.memory.seq_pos_min(0), into.memory.seq_pos_max(0), into.memory.used)
        with pytest.raises(StateError) as e:
            state.restore(into, st, 0)
        assert (into.memory.seq_pos_min(0), into.memory.seq_pos_max(0), into.memory.used) == before  # untouched
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "another model" in refused(tiny_state)
    q8 = Context(tiny_gemma_model, ContextParams(n_ctx=512, type_k="q8_0"))
    assert "cache type K is f16, this context's is q8_0" in refused(good, q8)
    small = Context(tiny_gemma_model, ContextParams(n_ctx=256, n_seq_max=8, kv_unified=False))
    small_ok = state.capture(small, 0, [])  # an empty sequence restores anywhere
    assert state.restore(small, state_file.from_bytes(state_file.to_bytes(small_ok)), 3) == 0
    with pytest.raises(StateError, match="out of range"):
        state.restore(target, good, 5)
    long_st = state_file.SeqState(dict(good.header), list(range(300)), good.tensors)
    assert "raise -c" in refused(long_st, small)
    for cut in (5, 100, len(data) // 2, len(data) - 1):
        with pytest.raises(StateError, match="truncated|not a state file"):
            state_file.from_bytes(data[:cut])
    flipped = bytearray(data)
    flipped[len(flipped) - 10] ^= 0xFF  # K/V bytes changed: still a state, restores (no checksum needed)
    assert state.restore(target, state_file.from_bytes(bytes(flipped)), 0) == 40
    wrong_pos = state_file.SeqState(good.header, prompt, {**good.tensors, "c0.pos": good.tensors["c0.pos"].flip(0)})
    assert "positions are invalid" in refused(wrong_pos)
    with pytest.raises(StateError, match="not found"):
        state_file.read_file(tmp_path / "missing.state")
    # restored into another sequence of the same context: the same continuation
    state.restore(ctx, good, 1)
    ctx.memory.seq_rm(1, 39, -1)
    ctx.decode(Batch.from_tokens([prompt[-1]], 39, 1))
    again = greedy(ctx, 40, ctx.logits[-1].clone(), 6, seq_id=1)
    ctx.memory.seq_rm(0, 39, -1)
    ctx.decode(Batch.from_tokens([prompt[-1]], 39, 0))
    assert greedy(ctx, 40, ctx.logits[-1].clone(), 6, seq_id=0) == again


def test_swa_full_state_into_a_window_sized_cache(tiny_gemma_model) -> None:  # type: ignore[no-untyped-def]
    """Saved with --swa-full (the SWA cache holds every cell), restored where it holds the window
    plus one ubatch: only the tail the window still needs is taken, and generation agrees."""
    full = Context(tiny_gemma_model, ContextParams(n_ctx=1024, n_ubatch=64, swa_full=True))
    prompt = [3 + i % 50 for i in range(300)]
    full.prefill(prompt)
    saved = state.capture(full, 0, prompt)
    assert saved.tensors["c1.pos"].numel() == 300
    small = Context(tiny_gemma_model, ContextParams(n_ctx=1024, n_ubatch=64))
    assert small.memory.caches[1].size < 300
    assert state.restore(small, saved, 0) == 300
    assert state.usable_prefix(small, 0, 299) == 299
    for ctx in (full, small):
        ctx.memory.seq_rm(0, 299, -1)
        ctx.decode(Batch.from_tokens([prompt[-1]], 299, 0))
    assert greedy(small, 300, small.logits[-1].clone(), 8) == greedy(full, 300, full.logits[-1].clone(), 8)


# -- Llama: llama-cpp-python's save_state / load_state ----------------------------------------------


def test_llama_save_and_load_state(tiny_gemma: Path, tmp_path: Path) -> None:
    kw = dict(n_ctx=256, type_k="f32", type_v="f32")
    a = Llama(model_path=str(tiny_gemma), **kw)
    prompt = "hello world the hello world how"
    ref = a.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    a.reset()
    a.eval(a.tokenize(prompt.encode()))
    st = a.save_state()
    assert st.n_tokens == a.n_tokens and st.llama_state_size == len(st.llama_state)
    a.save_state_file(tmp_path / "a.state")
    b = Llama(model_path=str(tiny_gemma), **kw)
    b.load_state(st)
    assert b.n_tokens == st.n_tokens
    assert b.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"] == ref
    c = Llama(model_path=str(tiny_gemma), **kw)
    assert c.load_state_file(tmp_path / "a.state") == st.n_tokens
    assert c.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"] == ref
    with pytest.raises(StateError, match="cache type"):
        Llama(model_path=str(tiny_gemma), n_ctx=256).load_state(st)


# -- the server: POST /slots/{id}?action=... -------------------------------------------------------


@pytest.fixture(scope="module")
def slot_server(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Scheduler, Path]]:
    d = tmp_path_factory.mktemp("slots")
    eng = start_server_engine(tiny_gemma, 2, 512)
    live = Live(create_app(eng, ServerOptions(slot_save_path=str(d))))
    yield live.url, eng.scheduler, d
    live.close()
    eng.stop()


def post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_slot_save_restore_into_another_slot(slot_server: tuple[str, Scheduler, Path]) -> None:
    url, sch, d = slot_server
    req = {"prompt": "hello world the hello world how are you", "n_predict": 8, "cache_prompt": True, **GREEDY}
    first = post(url, "/completion", {**req, "id_slot": 0}).json()
    saved = post(url, "/slots/0?action=save", {"filename": "s0.bin"}).json()
    n = first["tokens_evaluated"] + first["tokens_predicted"] - 1  # the last sampled token is not decoded
    assert saved["id_slot"] == 0 and saved["filename"] == "s0.bin" and saved["n_saved"] == n
    assert saved["n_written"] == (d / "s0.bin").stat().st_size and "save_ms" in saved["timings"]
    restored = post(url, "/slots/1?action=restore", {"filename": "s0.bin"}).json()
    assert restored["n_restored"] == n and restored["n_read"] == saved["n_written"]
    assert "restore_ms" in restored["timings"]
    again = post(url, "/completion", {**req, "id_slot": 1}).json()
    assert again["content"] == first["content"] and again["timings"]["prompt_n"] == 1
    erased = post(url, "/slots/1?action=erase", {}).json()
    assert erased == {"id_slot": 1, "n_erased": n} and sch.ctx.memory.seq_pos_max(1) == -1
    # slot 1's own cells are gone; the prompt's prefix now comes from slot 0's cells instead
    assert post(url, "/completion", {**req, "id_slot": 1}).json()["timings"]["prompt_n"] == 1
    assert (sch.slots[1].reuse.n_own, sch.slots[1].reuse.source) == (0, 0)


def test_slot_action_errors(slot_server: tuple[str, Scheduler, Path], tiny_state: state_file.SeqState) -> None:
    url, sch, d = slot_server
    post(url, "/completion", {"prompt": "hello world", "n_predict": 2, "id_slot": 0, **GREEDY})
    before = sch.ctx.memory.seq_pos_max(0)
    state_file.write_file(d / "llama.bin", tiny_state)
    (d / "junk.bin").write_bytes(b"junk" * 10)
    cases = [
        (
            "/slots/0?action=restore",
            {"filename": "llama.bin"},
            "Unable to restore slot: the state was saved with another model",
        ),
        ("/slots/0?action=restore", {"filename": "junk.bin"}, "Unable to restore slot: junk.bin: not a state file"),
        ("/slots/0?action=restore", {"filename": "nope.bin"}, "Unable to restore slot: cannot read nope.bin"),
        ("/slots/0?action=restore", {"filename": "../etc/passwd"}, "Invalid filename"),
        ("/slots/0?action=save", {"filename": "a/b"}, "Invalid filename"),
        ("/slots/7?action=save", {"filename": "x.bin"}, "Invalid slot ID"),
        ("/slots/x?action=save", {"filename": "x.bin"}, "Invalid slot ID"),
        ("/slots/0?action=dance", {}, "Invalid action"),
    ]
    for path, body, message in cases:
        r = post(url, path, body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["message"].startswith(message), (
            path,
            err,
        )
    assert sch.ctx.memory.seq_pos_max(0) == before  # nothing half-restored
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert not any(p.name.startswith("..") for p in d.parent.iterdir())


def test_slot_save_path_must_be_a_directory(tiny_gemma: Path, tmp_path: Path) -> None:
    r = run_cli(["server", "-m", str(tiny_gemma), "--slot-save-path", str(tmp_path / "no")])
    assert r.returncode == 1 and r.stderr.strip().endswith(f"not a directory: {tmp_path / 'no'}")


def test_filename_rules() -> None:
    for ok in ("slot1.bin", "a b.bin", "ünïcode.state", "x" * 255):
        assert valid_filename(ok), ok
    for bad in ("", ".", "..", "a..b", "../x", "a/b", "a\\b", " x", "x ", "x.", "a:b", "a\x01", "x" * 256, "a\ud800"):
        assert not valid_filename(bad), bad
