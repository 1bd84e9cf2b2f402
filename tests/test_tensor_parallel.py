"""Tensor parallelism over torch.distributed (gloo on this CPU machine), 2 ranks.

The cuts themselves are checked against the dense matrices; then real ranks (processes) run the
tiny llama and gemma models and the default model and must give the single process's greedy
tokens, with logits within 1e-4 of the logits' scale (Gemma 3 270M: 5e-4, see TOLERANCE), while rank 0's cell operations (seq_cp,
seq_rm, a context shift) are mirrored; the CLI both ways (`-tp 2`, torchrun), the Python API and
the server under concurrent requests give the same text; a killed rank makes the server answer
503 and exit with one line naming it; a rendezvous nobody joins is one line, not a hang.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from test_server_shutdown import Server

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.context.report import memory_plan
from ubatch.engine.errors import EngineError, ModelLoadError
from ubatch.engine.model.model import Model
from ubatch.engine.model.shard import Shard, col_slice, row_slice
from ubatch.engine.parallel.launch import Ranks, start
from ubatch.engine.parallel.worker import load_shard
from ubatch.engine.params import ContextParams
from ubatch.kernels.quant.weight import QWeight

CLI = [sys.executable, "-m", "ubatch"]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "GLOO_SOCKET_IFNAME": "lo"}  # every rank on this machine


def plan_shard(model: Model, world: int = 2) -> Model:
    return model.sharded(Shard.for_plan(world, model.hparams.n_vocab))


# -- the cuts, without any process --------------------------------------------------------------
def test_row_and_column_cuts_are_the_dense_slices(tiny_llama_model: Model) -> None:
    for w in (tiny_llama_model.layers[0].wq, tiny_llama_model.layers[1].wo, tiny_llama_model.layers[2].ffn_down):
        dense = w.dense()
        rows, cols = w.shape
        assert torch.equal(row_slice(w, rows // 2, rows).dense(), dense[rows // 2 :])
        assert torch.equal(col_slice(w, 0, cols // 2).dense(), dense[:, : cols // 2])
        assert torch.equal(col_slice(w, cols // 2, cols).dense(), dense[:, cols // 2 :])
    w = tiny_llama_model.layers[0].wq
    assert row_slice(w, 0, 4).raw.data_ptr() == w.raw.data_ptr()  # a view of the mapped bytes


def test_a_cut_off_the_block_boundary_and_heads_that_do_not_split_are_one_line(tiny_llama_model: Model) -> None:
    q4k = QWeight("blk.0.attn_output.weight", torch.zeros(4 * 144, dtype=torch.uint8), 12, (4, 256))  # Q4_K
    with pytest.raises(ModelLoadError, match=r"'blk.0.attn_output.weight' \(Q4_K, blocks of 256\).*column 128"):
        col_slice(q4k, 0, 128)
    with pytest.raises(ModelLoadError, match="4 attention heads do not split over 3 ranks; use a -tp that divides 4"):
        plan_shard(tiny_llama_model, 3)


def test_each_rank_holds_about_half_the_weights_and_kv(tiny_llama_model: Model, default_model: Model) -> None:
    p = ContextParams(n_ctx=1024, n_threads=1)
    for m, kv_half in ((tiny_llama_model, True), (default_model, False)):
        whole = Context(m, p)
        part = Context(plan_shard(m), p)
        a, b = memory_plan(whole), memory_plan(part)
        assert b.tp is not None and b.tp.world == 2 and a.tp is None
        assert 0.45 < b.model_bytes / a.model_bytes < 0.56, (b.model_bytes, a.model_bytes)
        # the default model has one KV head: each rank keeps a copy of it (as vLLM replicates)
        assert b.kv_bytes == (a.kv_bytes // 2 if kv_half else a.kv_bytes)
        assert b.tp.kv_replicated is not kv_half


def test_every_cell_operation_is_announced_to_the_other_ranks() -> None:
    """A KV memory method that changes cells from outside a decode must be mirrored, or the ranks'
    cells drift apart; the ones a decode calls itself run on every rank anyway."""
    from ubatch.engine.context.mirror import MEMORY_OPS, MirroredMemory
    from ubatch.engine.kv.memory import KVMemory

    public = {n for n, v in vars(KVMemory).items() if callable(v) and not n.startswith("_")}
    in_decode = {"build", "init_batch", "prepare", "place", "update"}
    reads = {"seq_pos_max", "seq_pos_min", "n_to_separate", "can_seq_cp", "can_seq_cp_past", "positions_apart"}
    assert public - in_decode - reads == set(MEMORY_OPS)
    assert all(n in vars(MirroredMemory) for n in MEMORY_OPS)


# -- real ranks ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    r = start(2, timeout_s=60)
    yield r
    r.stop()


def greedy(model: Model, tokens: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens on sequence 1, copied from sequence 0's prompt (seq_cp) and after seq 0 is
    removed, with a context shift halfway (seq_rm + seq_add over cells the prompt shares)."""
    ctx = Context(model, ContextParams(n_ctx=256, n_seq_max=2, n_threads=1))
    ctx.decode(Batch.from_tokens(tokens, 0, 0, True))
    logits = [ctx.logits.clone()]
    ctx.memory.seq_cp(0, 1)
    ctx.memory.seq_rm(0)
    out, pos = [int(ctx.logits[-1].argmax())], len(tokens)
    for i in range(n - 1):
        if i == n // 2:  # drop 4 tokens after the first 2 and close the gap, as a context shift does
            ctx.memory.seq_rm(1, 2, 6)
            ctx.memory.seq_add(1, 6, pos, -4)
            pos -= 4
        ctx.decode(Batch.from_tokens([out[-1]], pos, 1, True))
        pos += 1
        logits.append(ctx.logits.clone())
        out.append(int(ctx.logits[-1].argmax()))
    return out, logits


# max |logit difference| / max |logit|: the tiny models stay within 1e-4; Gemma 3 270M's residual
# stream reaches ~1e5, where summing two halves of a product in f32 rounds differently from one
# whole sum: measured 2.3e-4 (0.036 on logits of 154), less than the gap between two single-process
# backends on the same model (cpu vs torch reference: 0.041)
TOLERANCE = {"tiny_llama": 1e-4, "tiny_gemma": 1e-4, "default_model_path": 5e-4}


@pytest.mark.parametrize("name", list(TOLERANCE))
def test_two_ranks_give_the_single_process_tokens_and_logits(
    ranks: Ranks, name: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(name)
    prompt = list(range(10, 40))
    want, want_logits = greedy(Model.load(path), prompt, 64)
    got, got_logits = greedy(load_shard(ranks.group, str(path), "cpu"), prompt, 64)
    assert got == want
    for a, b in zip(want_logits, got_logits):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= TOLERANCE[name] * float(a.abs().max()), name


# -- the commands ---------------------------------------------------------------------------------
def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=env or ENV, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_both_launches_and_the_api_give_the_single_process_text(tiny_gemma: Path) -> None:
    args = ["cli", "-m", str(tiny_gemma), "-p", "hello world", "-n", "24", "--temp", "0", "-no-cnv", "-t", "1"]
    args += ["--no-display-prompt", "--log-disable"]
    single = run([*CLI, *args])
    assert single.returncode == 0, single.stderr
    spawned = run([*CLI, *args, "-tp", "2"])
    assert spawned.returncode == 0, spawned.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(free_port()), "-m", "ubatch", *args]
    launched = run(torchrun)
    assert launched.returncode == 0, launched.stderr
    assert single.stdout.strip()
    assert spawned.stdout == single.stdout
    assert launched.stdout == single.stdout  # rank 1 prints nothing
    api = f"""
from ubatch import Llama
a = Llama({str(tiny_gemma)!r}, n_ctx=256, n_threads=1)
b = Llama({str(tiny_gemma)!r}, n_ctx=256, n_threads=1, tensor_parallel=2)
x = a.create_completion("hello world", max_tokens=24, temperature=0)["choices"][0]["text"]
y = b.create_completion("hello world", max_tokens=24, temperature=0)["choices"][0]["text"]
b.close()
print(x == y, len(x))
"""
    r = run([sys.executable, "-c", api])
    assert r.returncode == 0 and r.stdout.split()[0] == "True", r.stdout + r.stderr


def test_a_rendezvous_nobody_joins_is_one_line(tiny_gemma: Path) -> None:
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    t0 = time.time()
    r = run([*CLI, "cli", "-m", str(tiny_gemma), "-p", "a", "-n", "1", "-no-cnv", "--tp-timeout", "3"], env=env)
    assert r.returncode == 1
    assert time.time() - t0 < 60  # the timeout, plus starting Python and torch on a busy machine
    assert "Traceback" not in r.stderr
    assert "tensor parallelism: rank 0 of 2 could not meet the others" in r.stderr, r.stderr


def ask(url: str, prompt: str, cached: list[int] | None = None) -> str:
    body = {"prompt": prompt, "n_predict": 16, "temperature": 0}
    r = httpx.post(url + "/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if cached is not None:
        cached.append(int(r.json()["tokens_cached"]))
    return str(r.json()["content"])


def test_server_concurrent_requests_and_a_killed_rank(tiny_llama: Path) -> None:
    # a long common prefix: the unified cache shares its cells between the slots (seq_cp), which
    # rank 0 must announce like every other cell operation
    common = "once upon a time there was a little town by the sea where " * 4
    prompts = [f"{common}story number {i} begins" for i in range(4)]
    srv = Server(tiny_llama, "-np", "2", "-kvu")
    try:
        want = [ask(srv.url, p) for p in prompts]
    finally:
        srv.close()
    srv = Server(tiny_llama, "-np", "2", "-kvu", "-tp", "2", "--tp-timeout", "10")
    try:
        assert "tensor parallel = 2 ranks" in srv.log
        got: list[str] = [""] * len(prompts)
        cached: list[int] = []

        def one(i: int) -> None:
            got[i] = ask(srv.url, prompts[i], cached)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert got == want
        assert max(cached) > 16  # a later request took the common prefix from cached cells
        # kill rank 1: what is asked next is answered 503 and the server exits with one line
        pid = int(srv.wait_line(r"rank 1 pid (\d+)").group(1))
        os.kill(pid, signal.SIGKILL)
        r = httpx.post(srv.url + "/completion", json={"prompt": "x", "n_predict": 4}, timeout=120)
        assert r.status_code == 503, r.text
        assert "rank 1" in r.json()["error"]["message"]
        assert srv.proc.wait(timeout=60) == 1
        srv._reader.join(5)
        assert "Traceback" not in srv.log
        last = [x for x in srv.lines if x.strip()][-1]
        assert "tensor parallelism: rank 1 (exit code -9) stopped answering" in last, srv.log
    finally:
        srv.close()


def listening_sockets(pids: list[int]) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of the listening TCP sockets the
    processes `pids` hold: their socket inodes matched against the namespace's socket tables."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append(cols[1].split(":")[0])
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_ranks_started_here_listen_on_loopback_only_and_a_rank_killed_mid_generation_stops_the_server(
    tiny_llama: Path,
) -> None:
    srv = Server(tiny_llama, "-np", "2", "-tp", "2", "--tp-timeout", "10", "--host", "127.0.0.1")
    try:
        pid = int(srv.wait_line(r"rank 1 pid (\d+)").group(1))
        addrs = listening_sockets([srv.proc.pid, pid])
        assert addrs and set(addrs) <= LOOPBACK, addrs  # no port on the machine's other addresses
        got: dict[str, httpx.Response] = {}
        long = {"prompt": "hello", "n_predict": 4000, "ignore_eos": True}
        gen = threading.Thread(target=lambda: got.update(r=httpx.post(srv.url + "/completion", json=long, timeout=120)))
        gen.start()
        srv.wait_line(r"processing task")
        time.sleep(0.5)  # well inside the 4000 tokens
        os.kill(pid, signal.SIGKILL)
        gen.join(60)
        r = got["r"]
        assert r.status_code == 503 and "rank 1 (exit code -9)" in r.json()["error"]["message"], r.text
        t0 = time.time()
        assert srv.proc.wait(timeout=30) == 1  # no healthy-looking server left behind
        assert time.time() - t0 < 30
        srv._reader.join(5)
        assert "Traceback" not in srv.log
        last = [x for x in srv.lines if x.strip()][-1]
        assert last.startswith("error: tensor parallelism: rank 1 (exit code -9) stopped answering"), srv.log[-2000:]
    finally:
        srv.close()


HANG = """
import os, signal, sys
from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.params import ContextParams
from ubatch.engine.parallel.launch import start
from ubatch.engine.parallel.worker import load_shard
if __name__ == "__main__":
    r = start(2, timeout_s=3)
    ctx = Context(load_shard(r.group, sys.argv[1], "cpu"), ContextParams(n_ctx=256, n_threads=1))
    ctx.decode(Batch.from_tokens([1, 2, 3], 0, 0, True))
    os.kill(r.procs[0].pid, signal.SIGSTOP)  # rank 1 hangs
    try:
        ctx.decode(Batch.from_tokens([4], 3, 0, True))
    except Exception as e:
        print(type(e).__name__, e)
    os.kill(r.procs[0].pid, signal.SIGKILL)
"""


def test_a_hung_rank_stops_rank_0_within_the_timeout(tiny_llama: Path, tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    r = run([sys.executable, str(script), str(tiny_llama)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("RankLost tensor parallelism: rank 1 (alive, not answering) stopped answering"), r.stdout
    assert "Timed out waiting 3000ms" in r.stdout


def test_info_answers_per_rank_and_how_many_ranks(default_model_path: Path) -> None:
    r = run([*CLI, "info", "-m", str(default_model_path), "-c", "8192", "-tp", "2", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tp"]["world"] == 2 and d["tp"]["n_head"] == [4, 2] and d["tp"]["n_vocab"] == [262144, 131072]
    assert d["model_bytes"] < 0.55 * d["tp"]["whole_bytes"]
    single = json.loads(run([*CLI, "info", "-m", str(default_model_path), "-c", "32768", "--json"]).stdout)
    assert single["total_bytes"] > 300 << 20  # one process does not fit; two ranks do
    r = run([*CLI, "info", "-m", str(default_model_path), "-c", "32768", "-tp", "0", "--fit", "300M", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tensor_parallel"] == 2 and d["plan"]["total_bytes"] <= 300 << 20
    r = run([*CLI, "cli", "-m", str(default_model_path), "-p", "a", "-ts", "3,1", "-sm", "row"])
    assert r.returncode == 1 and "unequal proportions cannot be honoured" in r.stderr


def test_state_files_are_refused_under_tensor_parallelism(tiny_llama_model: Model) -> None:
    from ubatch.engine.context.state import capture

    ctx = Context(plan_shard(tiny_llama_model), ContextParams(n_ctx=256, n_threads=1))
    with pytest.raises(EngineError, match="not supported with tensor parallelism"):
        capture(ctx, 0, [])
