"""The architecture registry (engine/model/archs): each module's declarations, and that nothing
else in the engine branches on an architecture."""

from __future__ import annotations

import math
import re
from functools import cache
from pathlib import Path

import pytest
import tiny_families
import torch
import triton_interp  # noqa: F401  (interpreter mode before any kernel module is imported)

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.model.archs import ARCHS, HF_MODEL_TYPES
from ubatch.engine.model.archs.base import HParams
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams

ENGINE = Path(__file__).resolve().parents[1] / "ubatch" / "engine"


def test_nothing_outside_the_registry_branches_on_an_architecture() -> None:
    """An architecture is one file: an architecture compared with a name (`arch == "gemma3"`,
    `arch in ("llama", ...)`) appears only in archs/."""
    hits = []
    for p in sorted(ENGINE.rglob("*.py")):
        if "archs" in p.parts:
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\barch\s*(==|!=)\s*[\"']|\barch\s+(not\s+)?in\s+[(\[{]\s*[\"']", line):
                hits.append(f"{p.relative_to(ENGINE)}:{i}: {line.strip()}")
    assert hits == []


def _hparams(arch: str) -> HParams:
    meta = {
        "general.architecture": arch,
        f"{arch}.block_count": 2,
        f"{arch}.embedding_length": 256,
        f"{arch}.feed_forward_length": 512,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.context_length": 1024,
        f"{arch}.vocab_size": 300,
        f"{arch}.logit_scale": 2.0,  # granite requires it
        f"{arch}.expert_count": 8,  # mixtures of experts require these
        f"{arch}.expert_used_count": 2,
        f"{arch}.expert_feed_forward_length": 512,
    }
    if arch == "deepseek2":  # latent attention: one compressed KV head of kv_lora_rank + RoPE dims
        meta |= {f"{arch}.attention.head_count_kv": 1, f"{arch}.attention.kv_lora_rank": 128,
                 f"{arch}.attention.key_length": 160, f"{arch}.attention.value_length": 128,
                 f"{arch}.rope.dimension_count": 32, f"{arch}.attention.key_length_mla": 96,
                 f"{arch}.attention.value_length_mla": 64, f"{arch}.leading_dense_block_count": 1,
                 f"{arch}.expert_shared_count": 1}  # fmt: skip
    return ARCHS[arch].read_hparams(meta, "test")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_tensor_is_declared_once_with_a_cut_that_fits_its_shape(arch: str) -> None:
    hp = _hparams(arch)
    specs = ARCHS[arch].layer_tensors(hp, 1)
    assert len({t.field for t in specs}) == len(specs) and len({t.name for t in specs}) == len(specs)
    assert all(t.name.startswith("blk.1.") for t in specs)
    rows = {"q_rows": hp.n_head * hp.n_embd_head_k, "k_rows": hp.n_head_kv * hp.n_embd_head_k}
    rows |= {"v_rows": hp.n_head_kv * hp.n_embd_head_v, "ff_rows": hp.n_ff}
    cols = {"q_cols": hp.n_head * hp.n_embd_head_v, "ff_cols": hp.n_ff}
    if hp.mla is not None:  # latent attention: q and the output span the heads' q·k and value widths
        rows["q_rows"] = hp.n_head * hp.mla.n_embd_head_k
        cols["q_cols"] = hp.n_head * hp.mla.n_embd_head_v
    if hp.moe is not None:  # each expert's matrix cut as a dense FFN's is
        rows["exp_rows"] = cols["exp_cols"] = hp.moe.n_ff_exp
        rows["sh_rows"] = cols["sh_cols"] = hp.moe.n_ff_shexp
        rows["exp_gate_up"] = 2 * hp.moe.n_ff_exp  # fused: each expert's gate rows, then its up rows
    for t in specs:
        if t.cut == "none" and hp.mla is not None:  # latent attention: -tp refused, nothing cut
            assert t.field in ("wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wk_b", "wv_b", "wo"), t
        elif t.parts:  # fused: its parts tile its rows, each cut as a tensor of its own would be
            assert t.kind == "fused" and sum(n for _, n, _ in t.parts) == t.shape[0], t
            assert all(rows[cut] == n for _, n, cut in t.parts), t
        elif t.cut == "head_exps":  # latent attention's per-head stacks (k_b, v_b): cut by heads
            assert t.kind == "experts" and len(t.shape) == 3 and t.shape[0] == hp.n_head, t
        elif t.kind == "experts":
            assert len(t.shape) == 3 and t.shape[0] == hp.n_expert, t
            assert t.shape[1:][0 if t.cut in rows else 1] == (rows | cols)[t.cut], t
        elif t.kind == "bias" and t.cut == "exp_rows":  # each expert's bias of its rows
            assert t.shape == (hp.n_expert, rows["exp_rows"]), t
        elif t.cut == "heads":  # one value per query head (gpt-oss's sinks)
            assert t.kind == "vector" and t.shape == (hp.n_head,), t
        elif t.cut == "summed":  # added after the ranks' sums: the residual's width
            assert t.kind == "bias" and t.shape[-1] == hp.n_embd, t
        elif t.cut in rows:
            assert t.shape[0] == rows[t.cut], t
        elif t.cut in cols:
            assert t.kind == "matrix" and t.shape[1] == cols[t.cut], t
        elif t.cut == "none":  # spans what ranks split: olmo2's norms over all heads
            assert t.kind == "vector" and t.shape[0] in rows.values(), t
        else:
            assert t.cut == "replicated" and t.kind in ("vector", "matrix", "bias"), t


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_missing_key_is_one_line_naming_it(arch: str) -> None:
    from ubatch.engine.errors import ModelLoadError
    from ubatch.engine.model.hparams import hparams_from_metadata

    meta = {"general.architecture": arch, f"{arch}.block_count": 2}
    with pytest.raises(ModelLoadError, match=rf"{arch}\.embedding_length") as e:
        hparams_from_metadata(meta, "f.gguf")
    assert "\n" not in str(e.value)


def test_hf_model_types_name_registered_architectures() -> None:
    assert HF_MODEL_TYPES and all(a.name in ARCHS for a in HF_MODEL_TYPES.values())
    with pytest.raises(
        Exception,
        match="not supported; ubatch runs llama, gemma3, gemma2, qwen2, qwen3, qwen3moe, gpt-oss, olmoe, deepseek2, qwen2moe, granitemoe, granite, olmo2, smollm3, phi3",
    ):
        from ubatch.engine.model.hparams import hparams_from_metadata

        hparams_from_metadata({"general.architecture": "mamba"}, "f.gguf")


# -- each family against transformers' fp32 forward -------------------------------------------------
FAMILY_NAMES = sorted(tiny_families.FAMILIES)
SEQ = torch.randint(3, tiny_families.VOCAB, (300,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def _source(root: Path, family: str, source: str) -> Path:
    """The checkpoint directory (ubatch's own reader), or its GGUF by llama.cpp's converter."""
    d = tiny_families.write_hf(root / family, family)
    if source == "hf":
        return d
    if tiny_families.llama_cpp_src() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not available (../shared/tools/llama-cpp.sh)")
    return tiny_families.convert_llama_cpp(d, root / f"{family}.{source}.gguf", source)


@cache
def _reference(family: str, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return tiny_families.hf_model(family)(torch.tensor([ids])).logits[0].double()


def _kld_top1(ref: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(ours.double(), -1)
    kld = (lp.exp() * (lp - lq)).sum(-1)
    return kld.mean().item(), (ref.argmax(-1) == ours.argmax(-1)).double().mean().item()


def _context(path: Path, backend: str, n_ubatch: int, n_seq: int = 1) -> Context:
    params = ContextParams(n_ctx=1024, n_ubatch=n_ubatch, n_seq_max=n_seq, kv_unified=n_seq > 1, type_k="f32",
                           type_v="f32", backend=backend, n_threads=2)  # fmt: skip
    return Context(Model.load(path), params)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("n_ubatch", [512, 7])
@pytest.mark.parametrize("source", ["f32", "hf"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_logits_match_transformers(
    family_dirs: Path, family: str, source: str, n_ubatch: int, backend: str
) -> None:
    """300 positions of one sequence: top-1 as transformers' fp32 forward everywhere, mean KLD
    at most 1e-4, with a whole prefill in one ubatch and in ubatches of 7 rows."""
    ctx = _context(_source(family_dirs, family, source), backend, n_ubatch)
    assert ctx.model.hparams.arch == tiny_families.FAMILIES[family].gguf_arch
    ctx.decode(Batch.from_tokens(SEQ, 0, all_logits=True))
    kld, top1 = _kld_top1(_reference(family, tuple(SEQ)), ctx.logits)
    assert top1 == 1.0 and kld <= 1e-4, (kld, top1)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_family_on_the_cuda_backend(family_dirs: Path, family: str) -> None:
    """The cuda backend (Triton's interpreter without a GPU) on the families' own ops: qwen2's
    biases, gemma2's soft-capped attention and logits; prefill and decode steps against
    transformers."""
    ids = SEQ[:20]
    ctx = _context(_source(family_dirs, family, "f32"), "cuda", 512)
    ctx.decode(Batch.from_tokens(ids[:17], 0, all_logits=True))
    rows = [ctx.logits.clone()]
    for i in range(17, 20):
        ctx.decode(Batch.from_tokens(ids[i : i + 1], i))
        rows.append(ctx.logits.clone())
    kld, top1 = _kld_top1(_reference(family, tuple(ids)), torch.cat(rows))
    assert top1 == 1.0 and kld <= 1e-4, (kld, top1)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_several_sequences_in_one_ubatch(family_dirs: Path, family: str) -> None:
    """Three sequences of different lengths decoded together: each gets its own logits."""
    seqs = [SEQ[:40], SEQ[100:125], SEQ[200:260]]
    ctx = _context(_source(family_dirs, family, "f32"), "cpu", 512, n_seq=3)
    batch = Batch()
    for s, ids in enumerate(seqs):
        for i, t in enumerate(ids):
            batch.token.append(t)
            batch.pos.append(i)
            batch.seq_id.append([s])
            batch.logits.append(True)
    ctx.decode(batch)
    row = 0
    for ids in seqs:
        kld, top1 = _kld_top1(_reference(family, tuple(ids)), ctx.logits[row : row + len(ids)])
        assert top1 == 1.0 and kld <= 1e-4, (kld, top1)
        row += len(ids)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_greedy_tokens_match_transformers(family_dirs: Path, family: str) -> None:
    """32 greedy tokens after a prompt, fed as ids: the same as transformers' greedy choice."""
    prompt = SEQ[:20]
    ctx = _context(_source(family_dirs, family, "f32"), "cpu", 512)
    ctx.decode(Batch.from_tokens(prompt, 0))
    ours = []
    for i in range(32):
        ours.append(int(ctx.logits[-1].argmax()))
        ctx.decode(Batch.from_tokens(ours[-1:], len(prompt) + i))
    model, ids = tiny_families.hf_model(family), list(prompt)
    with torch.no_grad():
        for _ in range(32):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[len(prompt) :]


def test_longrope_factors_follow_the_context_per_sequence_length(family_dirs: Path) -> None:
    """LongRoPE's long factors once a sequence's context exceeds the original length (16 in the
    tiny file), the short ones within it (llama.cpp's rule); with -np 8 a 256-cell context is
    still 256 per sequence when unified, 256 / 8 = 32 > 16 otherwise: long either way here."""
    model = Model.load(_source(family_dirs, "phi3-longrope", "f32"))
    assert model.hparams.n_ctx_orig == 16 and model.rope_long is not None and model.rope_short is not None
    assert model.rope_factors(16) is model.rope_short
    assert model.rope_factors(17) is model.rope_long
    assert not torch.equal(model.rope_long, model.rope_short)
    ctx = Context(model, ContextParams(n_ctx=256, n_threads=1, backend="cpu"))
    assert ctx.rope_freqs is model.rope_long
    # the cos/sin magnitude sqrt(1 + ln(2048 / 16) / ln(16)) the converter wrote, on the tables only
    assert abs(model.hparams.rope_mscale - (1 + math.log(128) / math.log(16)) ** 0.5) < 1e-6
    assert model.hparams.attn_scale == 1 / 8


def test_a_family_whose_norms_span_every_head_refuses_tensor_parallelism(family_dirs: Path) -> None:
    """olmo2 normalises Q and K over all heads at once: -tp is refused in one line naming it."""
    from ubatch.engine.errors import ModelLoadError
    from ubatch.engine.model.shard import Shard

    model = Model.load(_source(family_dirs, "olmo2", "hf"))
    with pytest.raises(ModelLoadError, match=r"olmo2's blk\.0\.attn_q_norm\.weight, .* without -tp") as e:
        model.sharded(Shard.for_plan(2, model.hparams.n_vocab))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", [f for f in FAMILY_NAMES if f != "olmo2"])
def test_family_on_two_ranks_gives_the_single_process_logits(family_dirs: Path, family: str) -> None:
    """-tp 2: each rank holds the heads, biases and FFN rows its specs' cuts give it; prefill and
    decode logits equal one process's within f32 summation order."""
    assert_two_ranks_match(_source(family_dirs, family, "f32"))


def assert_two_ranks_match(path: Path) -> None:
    """A prefill of 30 tokens and 8 greedy steps on two ranks (-tp 2) against one process."""
    from ubatch.engine.parallel.launch import start
    from ubatch.engine.parallel.worker import load_shard

    def run(model: Model) -> list[torch.Tensor]:
        # an f32 cache: an f16 one rounds each rank's differently summed K and V (6 gemma3 layers: 1e-3)
        params = ContextParams(n_ctx=256, n_threads=1, backend="cpu", type_k="f32", type_v="f32")
        ctx = Context(model, params)
        ctx.decode(Batch.from_tokens(SEQ[:30], 0, all_logits=True))
        out = [ctx.logits.clone()]
        for i in range(8):
            ctx.decode(Batch.from_tokens([int(out[-1][-1].argmax())], 30 + i))
            out.append(ctx.logits.clone())
        return out

    want = run(Model.load(path))
    ranks = start(2, timeout_s=60)
    try:
        got = run(load_shard(ranks.group, str(path), "cpu"))
    finally:
        ranks.stop()
    for a, b in zip(want, got, strict=True):
        assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())


PROMPT = "the quick brown fox"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_through_the_cli_entry_points(family_dirs: Path, family: str, tmp_path: Path) -> None:
    """Each family through what a user runs: `info` (the plan from shapes), `explain`, `bench`,
    a greedy completion, the same with the file as its own draft model (speculative decoding
    accepts every draft, so the text is the same), and with its prompt's state saved to a
    prompt cache and then reused."""
    from test_cli import ubatch_inproc

    path = _source(family_dirs, family, "f32")
    cache_file = tmp_path / "prompt.state"
    run = ["cli", "-m", path, "-p", PROMPT, "-n", "8", "--temp", "0", "-c", "256", "-t", "2"]
    runs = ubatch_inproc(
        {
            "info": ["info", "-m", path, "-c", "512", "-np", "2"],
            "explain": ["explain", "-m", path, "-p", PROMPT, "-p", "a second prompt", "-n", "3", "--temp", "0"],
            "bench": ["bench", "-m", path, "-p", "16", "-n", "4", "-r", "1", "-t", "2"],
            "plain": run,
            "spec": [*run, "-md", path],
            "save": [*run, "--prompt-cache", cache_file],
            "reuse": [*run, "--prompt-cache", cache_file],
        }
    )
    for name, r in runs.items():
        assert r.returncode == 0 and "Traceback" not in r.stderr, (name, r.stderr[-2000:])
    assert tiny_families.FAMILIES[family].gguf_arch in runs["info"].stdout + runs["info"].stderr
    assert "2 sequence(s)" in runs["explain"].stdout
    assert "tg4" in runs["bench"].stdout
    text = runs["plain"].stdout
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert runs["spec"].stdout == text and runs["save"].stdout == text and runs["reuse"].stdout == text
    assert cache_file.stat().st_size > 0


SERVED = ["qwen2", "gemma2", "phi3-longrope", "smollm3"]  # biases, soft-capping, fused tensors + LongRoPE, NoPE layers


def test_families_serve_greedy_text_as_the_cli_gives_it(family_dirs: Path) -> None:
    """A real `ubatch server` for families whose layers differ most (started together; the CLI
    test above runs every family through the same engine), each asked for a greedy completion
    over HTTP: the text the CLI's greedy run of the same file gives."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from test_cli import ubatch_inproc
    from test_server_cmdline import Server

    paths = {f: _source(family_dirs, f, "f32") for f in SERVED}
    want = {
        f: r.stdout[len(PROMPT) :]
        for f, r in ubatch_inproc(
            {
                f: ["cli", "-m", p, "-p", PROMPT, "-n", "8", "--temp", "0", "-c", "256", "-t", "1"]
                for f, p in paths.items()
            }
        ).items()
    }
    with ThreadPoolExecutor(len(paths)) as pool:
        servers = dict(zip(paths, pool.map(lambda p: Server(["-m", str(p), "-c", "256"]), paths.values())))
    try:
        for f, s in servers.items():
            body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0}
            got = httpx.post(s.url + "/completion", json=body, timeout=120).json()["content"]
            assert got == want[f].rstrip("\n"), (f, got, want[f])
    finally:
        for s in servers.values():
            s.stop()
        for s in servers.values():
            s.wait()
