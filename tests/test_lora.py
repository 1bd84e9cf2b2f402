"""LoRA adapters: tiny random PEFT adapters over a tiny llama checkpoint, as PEFT saves them and as
llama.cpp's convert_lora_to_gguf.py converts them, against transformers + PEFT's own forward."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import subprocess
import time
from functools import cache
from pathlib import Path

import httpx
import pytest
import tiny_families
import tiny_lora
import torch
import triton_interp  # (the cuda backend's kernels interpreted without a GPU: set before they load)
from test_cuda_backend import cuda_ops

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.errors import ContextError, ModelLoadError
from ubatch.engine.gguf.file import open_gguf
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams

FAMILY = "llama3"
SEQ = torch.randint(3, tiny_families.VOCAB, (48,), generator=torch.Generator().manual_seed(11)).tolist()
ADAPTERS = {1: (8, 16.0), 2: (4, 4.0)}  # seed -> (rank, alpha)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base checkpoint and its GGUFs, and each adapter as a PEFT directory and as GGUFs."""
    if tiny_families.llama_cpp_src() is None:
        pytest.skip("llama.cpp's converters are not available (../shared/tools/llama-cpp.sh)")
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    d = tiny_families.write_hf(root / FAMILY, FAMILY)
    out, jobs = {"dir": d}, []
    for t in ("f32", "f16"):
        jobs.append(tiny_lora.base_job(d, root / f"base.{t}.gguf", t))
        out[t] = jobs[-1][2]
    for seed, (rank, alpha) in ADAPTERS.items():
        ld = out[f"peft{seed}"] = tiny_lora.write_peft(root / f"lora{seed}", FAMILY, seed, rank, alpha)
        for t in ("f32", "f16", "q8_0") if seed == 1 else ("f32",):
            jobs.append(tiny_lora.lora_job(d, ld, root / f"lora{seed}.{t}.gguf", t))
            out[f"lora{seed}.{t}"] = jobs[-1][2]
    qwen = tiny_families.write_hf(root / "qwen2", "qwen2")  # another architecture's adapter
    jobs.append(tiny_lora.lora_job(qwen, tiny_lora.write_peft(root / "qwen2-lora", "qwen2", 1), root / "q.gguf"))
    out["qwen2-lora"] = jobs[-1][2]
    tiny_lora.convert_all(jobs)
    return out


@cache
def _reference(seed: int, scale: float = 1.0) -> torch.Tensor:
    """transformers + PEFT's fp32 logits of SEQ (seed 0: the base model)."""
    with torch.no_grad():
        if seed == 0:
            return tiny_families.hf_model(FAMILY)(torch.tensor([SEQ])).logits[0].double()
        rank, alpha = ADAPTERS[seed]
        m = tiny_lora.peft_model(FAMILY, seed, rank, alpha * scale)  # PEFT's scale is alpha / r
        return m(torch.tensor([SEQ])).logits[0].double()


def _kld(ref: torch.Tensor, ours: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(ours.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


def _context(model: Model, backend: str = "cpu", n_seq: int = 1, n_ubatch: int = 512) -> Context:
    params = ContextParams(n_ctx=512, n_ubatch=n_ubatch, n_seq_max=n_seq, kv_unified=n_seq > 1, type_k="f32",
                           type_v="f32", backend=backend, n_threads=2)  # fmt: skip
    return Context(model, params)


def _logits(ctx: Context, seq: list[int] = SEQ) -> torch.Tensor:
    ctx.memory.clear()
    ctx.decode(Batch.from_tokens(seq, 0, all_logits=True))
    return ctx.logits.clone()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("source", ["lora1.f32", "peft1", "lora2.f32", "lora1.f16"])
def test_adapter_logits_match_transformers_and_peft(files: dict[str, Path], source: str, backend: str) -> None:
    """y = W x + alpha / r * B (A x) on q, k, v, o, gate, up, down: the GGUF llama.cpp's converter
    writes and the PEFT directory itself give PEFT's logits (KLD <= 1e-5), far from the base's."""
    model = Model.load(files["f32"])
    i = model.load_adapter(files[source])
    ctx = _context(model, backend, n_ubatch=7 if backend == "cpu" else 512)
    ctx.set_adapters({i: 1.0})
    seed = int(source[4] if source.startswith("lora") else source[4])
    ours = _logits(ctx)
    assert _kld(_reference(seed), ours) <= 1e-5
    assert _kld(_reference(0), ours) > 1e-2  # the adapter changed the model


def test_an_f16_base_and_adapter_match_peft(files: dict[str, Path]) -> None:
    model = Model.load(files["f16"])
    model.load_adapter(files["lora1.f16"])
    ctx = _context(model)
    ctx.set_adapters({0: 1.0})
    assert _kld(_reference(1), _logits(ctx)) <= 1e-5


def test_a_q8_0_adapter_is_close_to_peft(files: dict[str, Path]) -> None:
    model = Model.load(files["f32"])
    model.load_adapter(files["lora1.q8_0"])
    ctx = _context(model)
    ctx.set_adapters({0: 1.0})
    assert _kld(_reference(1), _logits(ctx)) <= 1e-3


def test_the_user_scale_multiplies_alpha_over_rank(files: dict[str, Path]) -> None:
    model = Model.load(files["f32"])
    model.load_adapter(files["lora1.f32"])
    ctx = _context(model, "torch")
    ctx.set_adapters({0: 0.5})
    assert _kld(_reference(1, 0.5), _logits(ctx)) <= 1e-5


def test_scale_zero_is_the_base_model_exactly(files: dict[str, Path]) -> None:
    base = _logits(_context(Model.load(files["f32"])))
    model = Model.load(files["f32"])
    model.load_adapter(files["lora1.f32"])
    ctx = _context(model)
    assert torch.equal(_logits(ctx), base)  # loaded, not applied
    ctx.set_adapters({0: 0.0})
    assert torch.equal(_logits(ctx), base)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_rows_of_one_ubatch_each_apply_their_own_adapter(files: dict[str, Path], backend: str) -> None:
    """Five sequences in one ubatch (base, adapter 1, adapter 2, adapter 1 at 0.5, both adapters):
    each row gathers its own adapters' pairs in one segmented call per matrix (the C kernel; the
    cuda backend's Triton kernel, interpreted without a GPU); each sequence's logits are those it
    gets alone on the cpu backend, the decode step after the prompt too."""
    model = Model.load(files["f32"])
    model.load_adapter(files["lora1.f32"])
    model.load_adapter(files["lora2.f32"])
    sets: list[dict[int, float]] = [{}, {0: 1.0}, {1: 1.0}, {0: 0.5}, {0: 0.5, 1: 2.0}]
    n, k = 12 if backend == "cpu" else 4, len(sets)  # the interpreter is slow
    alone = []
    for s in sets:
        ctx = _context(model)
        ctx.set_adapters(s)
        ctx.decode(Batch.from_tokens(SEQ[:n], 0, all_logits=True))
        first = ctx.logits.clone()
        ctx.decode(Batch.from_tokens([SEQ[n]], n))
        alone.append(torch.cat([first, ctx.logits]))
    ctx = _context(model, n_seq=k)
    if backend == "cuda":
        model = Model.load(files["f32"], triton_interp.DEVICE)
        model.load_adapter(files["lora1.f32"])
        model.load_adapter(files["lora2.f32"])
        params = dataclasses.replace(ctx.params, backend="cuda")
        ctx = Context(model, params, cuda_ops())  # the matmuls as torch.mm: the LoRA kernel is under test
    for seq, s in enumerate(sets):
        ctx.set_seq_adapters(seq, s)
    b = Batch(
        token=SEQ[:n] * k,
        pos=list(range(n)) * k,
        seq_id=[[s] for s in range(k) for _ in range(n)],
        logits=[True] * (n * k),
    )
    ctx.decode(b)
    assert len(ctx.records) == 1
    assert ctx.records[0].loras == {1: ((0, 1.0),), 2: ((1, 1.0),), 3: ((0, 0.5),), 4: ((0, 0.5), (1, 2.0))}
    got = ctx.logits.cpu().clone().view(k, n, -1)
    ctx.decode(Batch([SEQ[n]] * k, [n] * k, [[s] for s in range(k)], [True] * k))  # one row each
    for seq in range(k):
        want = alone[seq]
        torch.testing.assert_close(got[seq], want[:n], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ctx.logits[seq].cpu(), want[n], atol=2e-4, rtol=1e-4)


def test_adapters_that_do_not_fit_the_model_are_one_line(files: dict[str, Path], tmp_path: Path) -> None:
    model = Model.load(files["f32"])
    with pytest.raises(ModelLoadError, match="general.type is 'model', not 'adapter'"):
        model.load_adapter(files["f32"])
    with pytest.raises(ModelLoadError, match="adapter is for 'qwen2' but the model is 'llama'"):
        model.load_adapter(files["qwen2-lora"])
    with pytest.raises(ModelLoadError, match="no adapter_config.json"):
        model.load_adapter(tmp_path)
    ctx = _context(model)
    with pytest.raises(ContextError, match="adapter id 3 does not exist"):
        ctx.set_adapters({3: 1.0})


def _cli(*args: object) -> str:
    from cli_inproc import run_cli

    r = run_cli(["cli", *map(str, args), "-n", "12", "--temp", "0", "-no-cnv", "--no-display-prompt", "--no-warmup"])
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_cli_applies_lora_and_lora_scaled(files: dict[str, Path]) -> None:
    """`ubatch cli --lora` changes the greedy text; `--lora-scaled F:0` is the base model's text;
    llama.cpp's older two-argument `--lora-scaled F 1` is `--lora F`; a PEFT directory is the GGUF
    conversion's text."""
    m, p = files["f32"], "hello there"
    base = _cli("-m", m, "-p", p)
    with_lora = _cli("-m", m, "-p", p, "--lora", files["lora1.f32"])
    assert with_lora != base
    assert _cli("-m", m, "-p", p, "--lora", files["peft1"]) == with_lora
    assert _cli("-m", m, "-p", p, "--lora-scaled", f"{files['lora1.f32']}:0") == base
    assert _cli("-m", m, "-p", p, "--lora-scaled", files["lora1.f32"], "1") == with_lora


def test_lora_flags_refuse_bad_values_in_one_line(files: dict[str, Path], tmp_path: Path) -> None:
    from cli_inproc import run_cli

    r = run_cli(["cli", "-m", str(files["f32"]), "-p", "x", "--lora-scaled", str(files["lora1.f32"])])
    assert r.returncode == 1 and "the format is FNAME:SCALE" in r.stderr
    r = run_cli(["cli", "-m", str(files["f32"]), "-p", "x", "--lora-scaled", f"{files['lora1.f32']}:abc"])
    assert r.returncode == 1 and f"{files['lora1.f32']}:abc: the format is" in r.stderr  # as typed, no emoji
    r = run_cli(["cli", "-m", str(files["f32"]), "-p", "x", "--lora", str(tmp_path / "missing.gguf")])
    assert r.returncode == 1 and "LoRA adapter not found" in r.stderr
    r = run_cli(["cli", "-m", str(files["f32"]), "-p", "x", "-n", "1", "--lora", str(files["qwen2-lora"])])
    assert r.returncode == 1 and "adapter is for 'qwen2'" in r.stderr and "Traceback" not in r.stderr


def test_info_counts_the_adapters(files: dict[str, Path]) -> None:
    import json

    from cli_inproc import run_cli

    r = run_cli(["info", "-m", str(files["f32"]), "-c", "256", "--json", "--lora", str(files["lora1.f32"])])
    plan = json.loads(r.stdout)
    assert [(a["n_pairs"], a["ranks"], a["alpha"]) for a in plan["loras"]] == [(14, [8], 16.0)]
    r = run_cli(["info", "-m", str(files["f32"]), "-c", "256", "--lora", str(files["lora1.f32"])])
    assert "LoRA adapter 0" in r.stdout


def test_a_server_batches_four_adapter_sets_each_as_alone(files: dict[str, Path]) -> None:
    """Two adapters, four concurrent greedy streams (base, adapter 1, adapter 2, adapter 1 at 0.5)
    through a real server: one decode carries all four, each text equals the request run alone;
    GET/POST /lora-adapters, /props and /slots show the scales; a prompt cached under one adapter
    set is never reused under another."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_server import Live

    from ubatch.cli.context_flags import ContextFlags
    from ubatch.cli.lora_flags import LoraFlags
    from ubatch.cli.server.app import ServerOptions, create_app
    from ubatch.cli.server.run import EngineOptions, load_engine

    lora = LoraFlags(lora=[str(files["lora1.f32"])], lora_scaled=[f"{files['lora2.f32']}:0.0"])
    ctx = ContextFlags(parallel=4, kv_unified=True, ctx_size=1024)
    eng = load_engine(EngineOptions(model=files["f32"], context=ctx, lora=lora, warmup=False, quiet=True))
    live = Live(create_app(eng, ServerOptions(slots=True), log_verbosity=None))
    try:
        url = live.url
        got = httpx.get(f"{url}/lora-adapters").json()
        assert [(a["id"], a["scale"]) for a in got] == [(0, 1.0), (1, 0.0)]
        assert got[0]["path"] == str(files["lora1.f32"]) and {"task_name", "prompt_prefix"} <= got[0].keys()
        sets = [[], [{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}], [{"id": 0, "scale": 0.5}]]
        body = {"prompt": "the quick brown fox", "n_predict": 24, "temperature": 0, "cache_prompt": True}

        def run(lora_field: list[dict[str, float]]) -> str:
            r = httpx.post(f"{url}/completion", json={**body, "lora": lora_field}, timeout=120)
            assert r.status_code == 200, r.text
            return str(r.json()["content"])

        alone = [run(s) for s in sets]  # one at a time: each after the others' prompts are cached
        assert len(set(alone)) == 4
        with ThreadPoolExecutor(16) as pool:  # 16 clients on 4 slots: the slots stay full
            together = list(pool.map(run, sets * 4))
        assert together == alone * 4
        recs = httpx.get(f"{url}/iterations").json()["records"]
        assert any(len(r["rows"]) == 4 for r in recs)  # the four streams in one decode
        shown = [[{"id": i, "scale": v} for i, v in sorted({e["id"]: e["scale"] for e in s}.items())] for s in sets]
        assert all(s["params"]["lora"] in shown for s in httpx.get(f"{url}/slots").json())
        # the global scales: a request without `lora` applies them as they are when it starts
        assert run([]) == alone[0]
        r = httpx.post(f"{url}/lora-adapters", json=[{"id": 1, "scale": 1.0}])
        assert r.json() == {"success": True}
        assert [a["scale"] for a in httpx.get(f"{url}/lora-adapters").json()] == [0.0, 1.0]
        assert httpx.get(f"{url}/props").json()["default_generation_settings"]["params"]["lora"] == [
            {"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}
        ]  # fmt: skip
        no_field = httpx.post(f"{url}/completion", json=body, timeout=120).json()["content"]
        assert no_field == alone[2]
        bad = httpx.post(f"{url}/completion", json={**body, "lora": [{"id": 7, "scale": 1}]})
        assert bad.status_code == 400 and "no LoRA adapter has id 7" in bad.text
        assert httpx.post(f"{url}/lora-adapters", json={"id": 0}).status_code == 400
    finally:
        live.close()
        eng.stop()


def test_the_python_api_takes_lora_path_and_lora_scale(files: dict[str, Path]) -> None:
    """llama-cpp-python's lora_path / lora_scale: the logits of the adapter at that scale."""
    from ubatch import Llama

    llm = Llama(str(files["f32"]), n_ctx=256, type_k="f32", type_v="f32", logits_all=True,
                lora_path=str(files["lora1.f32"]), lora_scale=0.5, n_threads=2)  # fmt: skip
    llm.eval(SEQ)
    assert _kld(_reference(1, 0.5), torch.from_numpy(llm.scores[: len(SEQ)]).double()) <= 1e-5


def test_explain_shows_the_adapters_each_row_applied(files: dict[str, Path]) -> None:
    import json

    from cli_inproc import run_cli

    args = ["explain", "-m", str(files["f32"]), "-p", "hello", "-p", "world", "-n", "2"]
    r = run_cli([*args, "--json", "--lora-scaled", f"{files['lora1.f32']}:0.5"])
    assert r.returncode == 0, r.stderr
    ubs = [u for c in json.loads(r.stdout)["calls"] for u in c["ubatches"]]
    assert ubs and all(u["loras"] == {str(s): [[0, 0.5]] for s in u["seq_ids"]} for u in ubs)
    r = run_cli([*args, "--lora-scaled", f"{files['lora1.f32']}:0.5"])
    assert "+lora 0@0.5" in r.stdout
    r = run_cli([*args, "--json"])
    assert all(u["loras"] == {} for c in json.loads(r.stdout)["calls"] for u in c["ubatches"])


LLAMA_BIN = Path(os.environ.get("LLAMA_BIN", Path.home() / ".cache/ubatch-yardstick/build/bin"))


def _llama_server_logprobs(args: list[str], ids: list[int], n_vocab: int) -> torch.Tensor:
    """llama-server's whole next-token distribution after each prefix of ids (n_probs = the
    vocabulary, greedy, the prompt cache reused), as scripts/family_fidelity.py reads it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(LLAMA_BIN / "llama-server"), *args, "--port", str(port), "-c", "256", "-np", "1", "-t", "2"]
    proc = subprocess.Popen([*cmd, "-ctk", "f32", "-ctv", "f32"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    # the server holds back a sampled byte token (part of a UTF-8 character) with its probs: byte
    # tokens are never sampled (logit_bias acts on sampling; n_probs reports the raw distribution)
    types = open_gguf(Path(args[args.index("-m") + 1])).metadata["tokenizer.ggml.token_type"]
    no_bytes = [[i, False] for i, t in enumerate(types) if int(t) == 6]
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.time() < deadline, (proc.stderr.read() if proc.stderr else b"")[-2000:]
            time.sleep(0.1)
        rows = []
        with httpx.Client(timeout=60) as c:
            for i in range(1, len(ids) + 1):
                body = {"prompt": ids[:i], "n_predict": 1, "n_probs": n_vocab, "cache_prompt": True, "temperature": 0,
                        "logit_bias": no_bytes}  # fmt: skip
                r = c.post(url + "/completion", json=body).json()
                assert "completion_probabilities" in r, str(r)[:500]
                top = r["completion_probabilities"][0]["top_logprobs"]
                row = torch.full((n_vocab,), -math.inf, dtype=torch.float64)
                for t in top:
                    row[t["id"]] = t["logprob"]
                rows.append(row)
        return torch.stack(rows)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(not (LLAMA_BIN / "llama-server").exists(), reason="llama.cpp's llama-server is not built")
def test_llama_server_with_the_same_adapters_gives_our_distributions(files: dict[str, Path]) -> None:
    """Side by side with llama.cpp on the same GGUFs: llama-server --lora A --lora-scaled B:0.5
    against ubatch applying {A: 1, B: 0.5}; next-token distributions at 16 positions, KLD <= 1e-5
    (F32 base and adapters), the same greedy token at each, and both far from the base model."""
    ids = SEQ[:16]
    model = Model.load(files["f32"])
    a, b = model.load_adapter(files["lora1.f32"]), model.load_adapter(files["lora2.f32"])
    ctx = _context(model)
    ctx.set_adapters({a: 1.0, b: 0.5})
    ours = torch.log_softmax(_logits(ctx, ids).double(), -1)
    args = ["-m", str(files["f32"]), "--lora", str(files["lora1.f32"]), "--lora-scaled", f"{files['lora2.f32']}:0.5"]
    theirs = _llama_server_logprobs(args, ids, ours.shape[1])
    assert _kld(theirs, ours) <= 1e-5
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))
    ctx.set_adapters({})
    assert _kld(theirs, _logits(ctx, ids)) > 1e-2
