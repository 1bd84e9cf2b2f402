"""Saved-state files that are not what they claim (engine/context/state_file.py): a device, a FIFO,
a directory, a socket, a truncated file, trailing bytes, a header declaring more than the file
holds, a state from an older ubatch: each is refused in one line before its body is read. A state
from a model differing in one field names that field. Real files, written by the real code paths
from the tiny GGUF models, and the real CLI and server once each."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import httpx
import pytest
import torch
from safetensors.torch import save
from test_server import Live, start_server_engine
from tiny_models import TinySpec, write_tiny_model

from ubatch import Llama
from ubatch.cli.server.app import ServerOptions, create_app
from ubatch.engine.batch import Batch
from ubatch.engine.context import state, state_file
from ubatch.engine.context.context import Context
from ubatch.engine.context.state_file import SeqState, StateError
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams

PROMPT = [3, 9, 14, 27, 5, 8, 40, 41, 12]


def saved(model: Model, path: Path, **params: object) -> SeqState:
    """A real state of PROMPT in `model`, written to `path` by write_file."""
    ctx = Context(model, ContextParams(n_ctx=256, **params))  # type: ignore[arg-type]
    ctx.prefill(PROMPT)
    st = state.capture(ctx, 0, PROMPT)
    state_file.write_file(path, st)
    return st


def refused_fast(path: Path | str, *match: str) -> str:
    """read_file refuses `path` in one line naming every `match`, in well under a second."""
    t0 = time.perf_counter()
    with pytest.raises(StateError) as e:
        state_file.read_file(path)
    assert time.perf_counter() - t0 < 10  # reading the device whole would never end: a hang guard
    msg = str(e.value)
    assert "\n" not in msg and all(m in msg for m in match), msg
    return msg


def refused_fast_src(path: Path, src: str) -> str:
    """read_file naming the file as `src`, as the server does."""
    with pytest.raises(StateError) as e:
        state_file.read_file(path, src)
    assert str(path) not in str(e.value)  # the server names the file, never its directory
    return str(e.value)


@pytest.fixture
def state_path(tiny_gemma_model: Model, tmp_path: Path) -> Path:
    p = tmp_path / "s.state"
    saved(tiny_gemma_model, p)
    return p


# -- what is not a regular file: refused from os.stat, before a byte is read -----------------------


def test_not_regular_files_are_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refused_fast("/dev/zero", "/dev/zero is a character device", "not a state file")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # no writer: opening it for reading would block
    refused_fast(fifo, str(fifo), "FIFO")
    refused_fast(tmp_path, str(tmp_path), "is a directory")
    monkeypatch.chdir(tmp_path)  # a short relative name: AF_UNIX paths are limited to ~100 bytes
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind("sock")
        refused_fast("sock", "sock is a socket")
    assert refused_fast(tmp_path / "missing.state") == f"cannot read {tmp_path / 'missing.state'} (not found)"
    assert "cannot read slot.bin (not found)" == refused_fast_src(tmp_path / "missing", "slot.bin")
    with pytest.raises(StateError, match="it is a directory"):  # never replaced by a state
        state_file.write_file(tmp_path, SeqState({}, []))


def test_llama_load_state_file_refuses_a_device(tiny_gemma: Path) -> None:
    llm = Llama(model_path=str(tiny_gemma), n_ctx=256)
    t0 = time.perf_counter()
    with pytest.raises(StateError, match="character device"):
        llm.load_state_file("/dev/zero")
    assert time.perf_counter() - t0 < 10  # reading the device whole would never end: a hang guard


def test_cli_prompt_cache_dev_zero_is_one_line(tiny_gemma: Path) -> None:
    cmd = [sys.executable, "-m", "ubatch.cli.main", "cli", "-m", str(tiny_gemma), "-no-cnv"]
    cmd += ["--prompt-cache", "/dev/zero", "-p", "hi", "-n", "1", "--no-warmup"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--prompt-cache /dev/zero" in errors[0] and "character device" in errors[0], r.stderr
    assert r.stderr.strip().splitlines()[-1] == errors[0]


# -- sizes: the file must be exactly as long as its header declares ------------------------------


def rewrite_header(data: bytes, edit: Callable[[dict[str, object]], None]) -> bytes:
    """The same body under an edited JSON header (its length prefix recomputed)."""
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8 : 8 + n])
    edit(head)
    raw = json.dumps(head).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def test_sizes_disagreeing_with_the_header_are_refused(state_path: Path, tmp_path: Path) -> None:
    data = state_path.read_bytes()
    bad = tmp_path / "bad.state"
    n = int.from_bytes(data[:8], "little")
    for cut, match in ((0, "too short: 0 bytes"), (5, "too short"), (8 + n // 2, "truncated")):
        bad.write_bytes(data[:cut])
        refused_fast(bad, str(bad), match)
    bad.write_bytes(data[:-1])
    refused_fast(bad, "truncated", f"{len(data) - 1} bytes", f"declares {len(data)}")
    bad.write_bytes(data + b"\0" * 10)
    refused_fast(bad, "10 bytes past its end")
    bad.write_bytes((1 << 62).to_bytes(8, "little") + data[8:])  # a header length past any bound
    refused_fast(bad, "does not start with a safetensors header length")
    bad.write_bytes((len(data)).to_bytes(8, "little") + data[8:])  # within the bound, past the file
    refused_fast(bad, "not a state file, or truncated")

    def huge(head: dict[str, object]) -> None:
        head["tokens"]["data_offsets"][1] = 10**15  # type: ignore[index]

    bad.write_bytes(rewrite_header(data, huge))
    assert int(refused_fast(bad, "truncated", "its header declares").rstrip(")").split()[-1]) > 10**15

    def negative(head: dict[str, object]) -> None:
        head["tokens"]["data_offsets"] = [-4, 8]  # type: ignore[index]

    bad.write_bytes(rewrite_header(data, negative))
    refused_fast(bad, "tensor table is malformed")
    for blob in (data[:-1], data + b"x"):  # the same rules for a state held in memory (Llama.load_state)
        with pytest.raises(StateError, match="truncated|past its end"):
            state_file.from_bytes(blob)


def test_a_state_from_an_older_ubatch_is_refused(tmp_path: Path) -> None:
    old = tmp_path / "old.state"
    meta = {"format": state_file.FORMAT, "version": "1", "model": "0" * 32, "model_name": "x"}
    old.write_bytes(save({"tokens": torch.tensor([1, 2], dtype=torch.int32)}, metadata=meta))
    assert refused_fast(old) == f"{old}: written by an older ubatch (state format 1); re-create it"


# -- another model: the message names what differs ------------------------------------------------


def file_type(ftype: int) -> Callable[[gguf.GGUFWriter, object], None]:
    return lambda w, _rng: w.add_file_type(ftype)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (TinySpec(matrix_types=(gguf.GGMLQuantizationType.Q8_0,)), "tensor types differ ("),
        (TinySpec(seed=1), "tensor data differs (same shapes and metadata"),
        (TinySpec(n_ff=96), "n_ff differs (96 vs 128), metadata differs (gemma3.feed_forward_length)"),
        (TinySpec(n_embd=128), "n_embd differs (128 vs 64)"),
        (TinySpec(arch="llama"), "architecture differs (llama vs gemma3)"),
    ],
    ids=["quant", "weights", "n_ff", "n_embd", "arch"],
)
def test_another_model_names_what_differs(
    spec: TinySpec, expected: str, tiny_gemma_model: Model, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # the same file name, so the same model name (a tiny model has no general.name)
    other = Model.load(write_tiny_model(tmp_path_factory.mktemp("other") / "tiny-gemma3.gguf", spec))
    st = saved(other, tmp_path_factory.mktemp("s") / "o.state")
    target = Context(tiny_gemma_model, ContextParams(n_ctx=256))
    with pytest.raises(StateError) as e:
        state.restore(target, st, 0)
    msg = str(e.value)
    assert msg.startswith("the state was saved with another model (saved vs this one): ") and "\n" not in msg
    assert expected in msg and "model name" not in msg, msg


def test_file_type_and_kv_type_both_named(tmp_path: Path) -> None:
    """llama-server's case: the same model name, another quantisation, another -ctk."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = Model.load(write_tiny_model(tmp_path / "a" / "m.gguf", TinySpec(extra=file_type(15))))
    b = Model.load(write_tiny_model(tmp_path / "b" / "m.gguf", TinySpec(extra=file_type(7))))
    saved(a, tmp_path / "a.state", type_k="q8_0")
    st, _ = state_file.read_file(tmp_path / "a.state")
    with pytest.raises(StateError) as e:
        state.restore(Context(b, ContextParams(n_ctx=256)), st, 0)
    assert str(e.value) == (
        "the state was saved with another model (saved vs this one): file type differs (Q4_K_M vs Q8_0), "
        "KV cache type K differs (q8_0 vs f16)"
    )


# -- and a good file still round-trips ------------------------------------------------------------


def greedy(ctx: Context, n_past: int, n: int) -> list[int]:
    out: list[int] = []
    logits = ctx.logits[-1].clone()
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        ctx.decode(Batch.from_tokens([out[-1]], n_past, 0))
        n_past, logits = n_past + 1, ctx.logits[-1].clone()
    return out


def test_round_trip_through_a_file(tiny_gemma_model: Model, tmp_path: Path) -> None:
    path = tmp_path / "ok.state"
    a = Context(tiny_gemma_model, ContextParams(n_ctx=256))
    a.prefill(PROMPT)
    n_written = state_file.write_file(path, state.capture(a, 0, PROMPT))
    st, n_read = state_file.read_file(path)
    assert n_read == n_written == path.stat().st_size and st.tokens == PROMPT
    assert st.header["model_name"] == "tiny-gemma3" and st.header["version"] == str(state_file.VERSION)
    b = Context(tiny_gemma_model, ContextParams(n_ctx=256))
    assert state.restore(b, st, 0) == len(PROMPT)
    for ctx in (a, b):
        ctx.memory.seq_rm(0, len(PROMPT) - 1, -1)
        ctx.decode(Batch.from_tokens([PROMPT[-1]], len(PROMPT) - 1, 0))
    assert greedy(b, len(PROMPT), 6) == greedy(a, len(PROMPT), 6)


# -- the server: a bad slot file is a 400 naming the problem ---------------------------------------


@pytest.fixture(scope="module")
def slot_server(tiny_gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    d = tmp_path_factory.mktemp("slots")
    eng = start_server_engine(tiny_gemma, 2, 512)
    live = Live(create_app(eng, ServerOptions(slot_save_path=str(d))))
    yield live.url, d
    live.close()
    eng.stop()


def test_slot_restore_of_bad_files(
    slot_server: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory, tiny_gemma_model: Model
) -> None:
    url, d = slot_server
    good = d / "good.bin"
    saved(tiny_gemma_model, good)
    data = good.read_bytes()
    (d / "cut.bin").write_bytes(data[:-3])
    (d / "long.bin").write_bytes(data + b"\0")
    q8 = Model.load(
        write_tiny_model(
            tmp_path_factory.mktemp("q8") / "tiny-gemma3.gguf", TinySpec(matrix_types=(gguf.GGMLQuantizationType.Q8_0,))
        )
    )
    saved(q8, d / "q8.bin")
    (d / "zero.bin").symlink_to("/dev/zero")  # read whole, it would never end
    outside = tmp_path_factory.mktemp("outside") / "secret.txt"
    outside.write_bytes(b"TOPSECRET and more")  # a file out of the folder, reached by a link in it
    (d / "secret.bin").symlink_to(outside)
    os.mkfifo(d / "fifo.bin")  # opened for reading, it would block until a writer comes
    (d / "dir.bin").mkdir()
    for name, message in (
        ("zero.bin", "Unable to restore slot: zero.bin is a symbolic link, not a state file"),
        ("secret.bin", "Unable to restore slot: secret.bin is a symbolic link, not a state file"),
        ("fifo.bin", "Unable to restore slot: fifo.bin is a FIFO"),
        ("dir.bin", "Unable to restore slot: dir.bin is a directory"),
        ("cut.bin", "Unable to restore slot: cut.bin: the state file is truncated"),
        ("long.bin", "Unable to restore slot: long.bin: the state file has 1 bytes past its end"),
        ("q8.bin", "Unable to restore slot: the state was saved with another model (saved vs this one): tensor types"),
    ):
        r = httpx.post(f"{url}/slots/0?action=restore", json={"filename": name}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["message"].startswith(message) and "\n" not in err["message"], err
    r = httpx.post(f"{url}/slots/0?action=restore", json={"filename": "good.bin"}, timeout=60)
    assert r.status_code == 200 and r.json()["n_restored"] == len(PROMPT)
    (d / "text.bin").write_bytes(b"TOPSECRET and more")  # not a state file: its bytes are never quoted
    r = httpx.post(f"{url}/slots/0?action=restore", json={"filename": "text.bin"}, timeout=60)
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "not a state file" in msg, msg
    assert str(int.from_bytes(b"TOPSECRE", "little")) not in msg and "TOPSECRE" not in msg


def test_a_slot_file_name_of_250_bytes_saves_and_restores(slot_server: tuple[str, Path]) -> None:
    """The temporary file beside the target used to be the name plus `.tmpPID`: past 255 bytes."""
    url, d = slot_server
    name = "s" * 246 + ".bin"
    assert len(name.encode()) == 250
    httpx.post(f"{url}/completion", json={"prompt": "hello there", "n_predict": 1, "id_slot": 0}, timeout=60)
    r = httpx.post(f"{url}/slots/0?action=save", json={"filename": name}, timeout=60)
    assert r.status_code == 200, r.text
    assert (d / name).is_file() and not [p for p in d.iterdir() if p.name.endswith(".tmp")]
    r = httpx.post(f"{url}/slots/1?action=restore", json={"filename": name}, timeout=60)
    assert r.status_code == 200 and r.json()["n_restored"] > 0, r.text
