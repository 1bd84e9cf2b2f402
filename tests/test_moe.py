"""Mixtures of experts: the expert ops on every backend against the reference, and each MoE
family's tiny random checkpoint (converted by llama.cpp's own converter) against transformers'
fp32 forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tiny_families
import torch
import triton_interp
from gguf import GGMLQuantizationType as T
from test_archs import SEQ, _context, _kld_top1, assert_two_ranks_match
from test_kernels import reads_x16, rel_err, weight, x16_round

from ubatch.engine.batch import Batch
from ubatch.kernels import backends
from ubatch.kernels.ops import MoeTopKArgs, MoeWeightsArgs, MulMatIdArgs
from ubatch.kernels.quant.dequant import dequantize
from ubatch.kernels.quant.weight import QWeight
from ubatch.kernels.torch_ops import TorchOps

BACKENDS = [b for b in backends.names() if b not in ("auto", "cuda")]


def experts(t: T, n_expert: int, rows: int, cols: int) -> QWeight:
    """n_expert random matrices of type t stacked as one 3-D tensor, as a GGUF file stores them."""
    ws = [weight(t, rows, cols, seed=e) for e in range(n_expert)]
    return QWeight(f"exps_{t.name}", torch.cat([w.raw for w in ws]), int(t), (n_expert, rows, cols))


def chosen(n: int, k: int, n_expert: int, seed: int = 0) -> torch.Tensor:
    """(n, k) int32: k distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n_expert, generator=g)[:k] for _ in range(n)]).to(torch.int32)


def run_mul_mat_id(ops, w: QWeight, x: torch.Tensor, ids: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    n, k = ids.shape
    out = torch.full((n, k, w.shape[1]), float("nan"))
    scratch = [torch.empty(s, dtype=d) for s, d in ops.mul_mat_id_scratch(n, k, w)]
    ops.prepare_weights([w])
    return ops.mul_mat_id(MulMatIdArgs(x, w, ids, b), out, scratch)


def mul_mat_id_reference(ops, w: QWeight, x: torch.Tensor, ids: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Each (token, chosen expert) row against that expert's dequantised matrix, in f64."""
    n, k = ids.shape
    dense = dequantize(w.raw, w.ggml_type, w.shape).double()
    xe = x.expand(n, k, x.shape[2])
    out = torch.empty(n, k, w.shape[1], dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            e = int(ids[t, j])
            row = xe[t, j : j + 1]
            group = int((ids == e).sum())  # the rows of one product (the GEMM past 16: x in f32 for the IQ types)
            xr = x16_round(row) if reads_x16(ops, T(w.ggml_type), group) else row.double()
            out[t, j] = (xr @ dense[e].t())[0] + (0 if b is None else b[e].double())
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def ops(request):
    return backends.create(request.param, n_threads=2)


@pytest.mark.parametrize("n", [1, 3, 40])
@pytest.mark.parametrize("t", [T.F32, T.F16, T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4, T.IQ4_XS], ids=lambda t: t.name)
def test_mul_mat_id_matches_each_chosen_expert_alone(ops, t: T, n: int) -> None:
    """1 and 3 tokens (decode: the GEMV), 40 tokens choosing 3 of 4 experts (an expert's group
    past 16 rows: the GEMM), with the token's row shared by its experts or one row each, with
    and without per-expert biases."""
    cols = 256 if t in (T.Q4_K, T.Q6_K, T.IQ4_XS) else 96
    w = experts(t, 4, 48, cols)
    ids = chosen(n, 3, 4, seed=n)
    g = torch.Generator().manual_seed(n)
    for x in (torch.randn(n, 1, cols, generator=g), torch.randn(n, 3, cols, generator=g)):
        for b in (None, torch.randn(4, 48, generator=g)):
            got = run_mul_mat_id(ops, w, x, ids, b)
            assert rel_err(got, mul_mat_id_reference(ops, w, x, ids, b)) <= 1e-5


def test_mul_mat_id_reads_only_the_chosen_experts() -> None:
    """Experts no token chose hold NaN: the C kernels never read them, so every output is finite."""
    ops = backends.create("cpu", n_threads=2)
    w = experts(T.F32, 8, 32, 64)
    poisoned = w.raw.view(torch.float32).view(8, 32, 64).clone()
    ids = torch.tensor([[1, 5], [5, 2], [2, 1]], dtype=torch.int32)
    poisoned[[0, 3, 4, 6, 7]] = float("nan")
    w = QWeight("poisoned", poisoned.view(-1).view(torch.uint8), int(T.F32), (8, 32, 64))
    for n in (1, 3):
        x = torch.randn(n, 1, 64)
        assert torch.isfinite(run_mul_mat_id(ops, w, x, ids[:n])).all()


@pytest.mark.parametrize(
    ("gating", "norm", "scale", "bias"),
    [
        ("softmax", True, 1.0, False),
        ("softmax", False, 2.5, False),
        ("sigmoid", True, 1.0, True),
        ("softmax_weight", False, 1.0, False),
    ],  # fmt: skip
)
def test_routing_matches_the_reference(ops, gating: str, norm: bool, scale: float, bias: bool) -> None:
    """Each row's top-k experts and their weights: softmax (qwen3moe), softmax with a scale,
    sigmoid with the selection bias (deepseek's), a softmax over the chosen logits (gpt-oss)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 16, generator=g)
    b = torch.randn(16, generator=g) if bias else None
    ref = TorchOps()
    want_ids = ref.moe_topk(MoeTopKArgs(logits, 4, gating, b), torch.empty(9, 4, dtype=torch.int32))
    ids = ops.moe_topk(MoeTopKArgs(logits, 4, gating, b), torch.empty(9, 4, dtype=torch.int32))
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    want = ref.moe_weights(MoeWeightsArgs(logits, ids, gating, norm, scale), torch.empty(9, 4))
    got = ops.moe_weights(MoeWeightsArgs(logits, ids, gating, norm, scale), torch.empty(9, 4))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    if norm:
        assert torch.allclose(got.sum(-1), torch.full((9,), scale))


@pytest.mark.parametrize(("n_group", "n_group_used", "k"), [(4, 2, 3), (8, 3, 6), (4, 1, 4)])
def test_group_limited_routing_matches_transformers_deepseek_v3_router(ops, n_group, n_group_used, k) -> None:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter, its logits the rows themselves):
    sigmoid scores plus the selection bias, the best groups by their two best biased scores, the
    top k inside them, the unbiased scores of those renormalised and scaled. 64 rows of 16 or 32
    experts; the group limit must change some row's choice, else the test would not see it."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    n_expert = 4 * n_group
    cfg = DeepseekV3Config(
        hidden_size=n_expert, n_routed_experts=n_expert, num_experts_per_tok=k, n_group=n_group,
        topk_group=n_group_used, norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(n_group * 10 + k)
    logits = 2 * torch.randn(64, n_expert, generator=g)
    bias = 0.3 * torch.randn(n_expert, generator=g)
    with torch.no_grad():
        router.weight.copy_(torch.eye(n_expert))
        router.e_score_correction_bias.copy_(bias)
        _, want_w, want_ids = router(logits)
    args = MoeTopKArgs(logits, k, "sigmoid", bias, n_group, n_group_used)
    ids = ops.moe_topk(args, torch.empty(64, k, dtype=torch.int32))
    assert torch.equal(ids.sort(-1).values, want_ids.int().sort(-1).values)
    w = ops.moe_weights(MoeWeightsArgs(logits, ids, "sigmoid", True, 2.5), torch.empty(64, k))
    order = want_ids.argsort(-1)
    torch.testing.assert_close(w.gather(1, ids.long().argsort(-1)), want_w.gather(1, order), rtol=1e-5, atol=1e-6)
    plain = ops.moe_topk(MoeTopKArgs(logits, k, "sigmoid", bias), torch.empty(64, k, dtype=torch.int32))
    assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)


def test_mul_mat_id_on_the_cuda_backend() -> None:
    """The Triton kernel (its interpreter without a GPU): decode and prefill shapes, quantised
    and float experts, shared and per-expert rows, biases."""
    ops = backends.create("cuda", n_threads=1)
    dev = triton_interp.DEVICE
    for t in (T.Q8_0, T.Q4_K, T.F16, T.MXFP4):
        cols = 256
        w = experts(t, 4, 32, cols)
        for n, per in ((1, 1), (5, 2)):
            ids = chosen(n, 2, 4, seed=n)
            x = torch.randn(n, per, cols, generator=torch.Generator().manual_seed(n))
            b = torch.randn(4, 32)
            want = mul_mat_id_reference(TorchOps(), w, x, ids, b)
            wd = w.to(dev)
            got = run_mul_mat_id(ops, wd, x.to(dev), ids.to(dev), b.to(dev)).cpu()
            assert rel_err(got, want) <= 1e-4, (t, n, per)


# -- families --------------------------------------------------------------------------------------
MOE_NAMES = sorted(tiny_families.MOE_FAMILIES)


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe_families")


def _gguf(root: Path, family: str, outtype: str) -> Path:
    if tiny_families.llama_cpp_src() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not available (../shared/tools/llama-cpp.sh)")
    d = tiny_families.write_hf(root / family, family)
    return tiny_families.convert_llama_cpp(d, root / f"{family}.{outtype}.gguf", outtype)


_REFS: dict[tuple[str, tuple[int, ...], str], torch.Tensor] = {}


def _reference(family: str, ids: list[int], outtype: str = "f32") -> torch.Tensor:
    """transformers' fp32 forward; for an F16 file, of the weights the converter writes as F16
    rounded to f16 (every matrix but the router): an expert a rounding moves past its rival is a
    choice of the weights, not of the runner, and tiny random routers have near ties."""
    key = (family, tuple(ids), outtype)
    if key not in _REFS:
        model = tiny_families.hf_model(family)
        with torch.no_grad():
            if outtype == "f16":
                for name, p in model.named_parameters():
                    if p.dim() >= 2 and not name.endswith(("mlp.gate.weight", "mlp.router.weight", "_bias")):
                        p.copy_(p.half().float())
            _REFS[key] = model(torch.tensor([ids])).logits[0].double()
    return _REFS[key]


@pytest.mark.parametrize(
    ("outtype", "backend", "n_ubatch"),
    [("f32", "torch", 512), ("f32", "cpu", 512), ("f32", "cpu", 7), ("f16", "cpu", 512)],
)
@pytest.mark.parametrize("family", MOE_NAMES)
def test_moe_family_logits_match_transformers(
    moe_dirs: Path, family: str, outtype: str, backend: str, n_ubatch: int
) -> None:
    """300 positions: top-1 as transformers' fp32 forward everywhere (of the F16 file's weights
    for the F16 file), mean KLD at most 1e-4, in one ubatch (experts' groups past the GEMV's 16 rows) and in ubatches of 7 rows."""
    ctx = _context(_gguf(moe_dirs, family, outtype), backend, n_ubatch)
    assert ctx.model.hparams.arch == tiny_families.family_of(family).gguf_arch
    ctx.decode(Batch.from_tokens(SEQ, 0, all_logits=True))
    kld, top1 = _kld_top1(_reference(family, SEQ, outtype), ctx.logits)
    assert top1 == 1.0 and kld <= 1e-4, (kld, top1)


@pytest.mark.parametrize("family", MOE_NAMES)
def test_moe_family_greedy_tokens_and_shared_ubatches_match_transformers(moe_dirs: Path, family: str) -> None:
    """32 greedy tokens equal transformers'; then three sequences in one ubatch each get their
    own logits (the rows' experts grouped across sequences)."""
    path = _gguf(moe_dirs, family, "f32")
    prompt = SEQ[:20]
    ctx = _context(path, "cpu", 512)
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

    seqs = [SEQ[:40], SEQ[100:125], SEQ[200:260]]
    ctx = _context(path, "cpu", 512, n_seq=3)
    batch = Batch()
    for s, toks in enumerate(seqs):
        for i, t in enumerate(toks):
            batch.token.append(t)
            batch.pos.append(i)
            batch.seq_id.append([s])
            batch.logits.append(True)
    ctx.decode(batch)
    row = 0
    for toks in seqs:
        kld, top1 = _kld_top1(_reference(family, toks), ctx.logits[row : row + len(toks)])
        assert top1 == 1.0 and kld <= 1e-4, (kld, top1)
        row += len(toks)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("expert_group_count", 3, "a divisor of expert_count = 16 with 2+ experts a group"),
        ("expert_group_count", 16, "a divisor of expert_count = 16 with 2+ experts a group"),
        ("expert_group_used_count", 0, "an integer in [1, 4]"),
        ("expert_group_used_count", None, "expert_group_used_count"),
    ],
)
def test_expert_groups_that_cannot_route_are_refused_in_one_line(
    moe_dirs: Path, tmp_path: Path, key: str, value: object, expected: str
) -> None:
    """Groups of one expert (a group is scored by its two best), a count that does not divide
    the experts, no used count: each a one-line load error naming the key."""
    from ubatch.engine.errors import ModelLoadError
    from ubatch.engine.model.model import Model

    bad = tiny_families.rewrite_gguf(
        _gguf(moe_dirs, "deepseek2-v3", "f32"), tmp_path / "bad.gguf", {f"deepseek2.{key}": value}
    )
    with pytest.raises(ModelLoadError) as e:
        Model.load(bad)
    msg = str(e.value)
    assert "\n" not in msg and f"deepseek2.{key}" in msg and expected in msg, msg


def _prefill_then_decode(ctx, n_decode: int) -> torch.Tensor:
    """The logits of SEQ's first 40 tokens as one prefill, then of n_decode one-token steps."""
    ctx.decode(Batch.from_tokens(SEQ[:40], 0, all_logits=True))
    rows = [ctx.logits.clone()]
    for i in range(40, 40 + n_decode):
        ctx.decode(Batch.from_tokens(SEQ[i : i + 1], i))
        rows.append(ctx.logits.clone())
    return torch.cat(rows)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_fused_gate_up_experts_give_the_unfused_files_logits(moe_dirs: Path, outtype: str) -> None:
    """A deepseek2 file may hold each expert's gate and up as one ffn_gate_up_exps (llama.cpp's
    loader takes either): the converted file with those tensors fused by the gguf package runs
    one product for both and gives bit-equal logits, prefill and decode; one with both forms
    and a fused file of an architecture whose llama.cpp loader reads only the parts are refused."""
    from ubatch.engine.errors import ModelLoadError
    from ubatch.engine.model.model import Model

    src = _gguf(moe_dirs, "deepseek2-v3", outtype)
    fused = moe_dirs / f"deepseek2-v3.{outtype}.gate_up.gguf"
    if not fused.exists():
        tiny_families.rewrite_gguf(src, fused, tensors=tiny_families.fuse_gate_up_exps)
    out = []
    for path in (src, fused):
        ctx = _context(path, "cpu", 512)
        out.append(_prefill_then_decode(ctx, 4))
    m = ctx.model
    assert "ffn_gate_up_exps" in m.layers[1].mats and "ffn_gate_exps" not in m.layers[1].mats
    assert m.layers[1].mat("ffn_gate_up_exps").shape == (16, 512, 256)
    assert torch.equal(out[0], out[1])

    def both(ts: list) -> list:
        return ts + [t for t in tiny_families.fuse_gate_up_exps(ts) if "gate_up" in t.name]

    with pytest.raises(ModelLoadError, match="blk.1.ffn_gate_up_exps.weight' and 'blk.1.ffn_gate_exps.weight'"):
        Model.load(tiny_families.rewrite_gguf(src, moe_dirs / f"both.{outtype}.gguf", tensors=both))
    other = moe_dirs / f"qwen3moe.{outtype}.gate_up.gguf"
    tiny_families.rewrite_gguf(_gguf(moe_dirs, "qwen3moe", "f32"), other, tensors=tiny_families.fuse_gate_up_exps)
    with pytest.raises(ModelLoadError, match="fused ffn_gate_up_exps tensors are not supported for qwen3moe"):
        Model.load(other)


@pytest.mark.parametrize("t", [T.F32, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_tensor_parallel_cut_of_fused_gate_up_experts_is_each_halfs_cut(t: T) -> None:
    """-tp cuts a fused ffn_gate_up_exps as the two tensors it stands for: each rank holds, per
    expert, its rows of the gate then its rows of the up, the bytes of cutting each alone."""
    from ubatch.engine.model.shard import Cutter, head_split

    gate, up = experts(t, 4, 512, 256), experts(t, 4, 512, 256)
    g3, u3 = gate.raw.view(4, 512, -1), up.raw.view(4, 512, -1)
    fused = QWeight("gate_up", torch.cat([g3, u3], 1).reshape(-1), int(t), (4, 1024, 256))
    for rank in range(2):
        c = Cutter(head_split(4, 4, rank, 2), 64, 64, 1024, rank, 2, n_ff_exp=512)
        got = c.matrix("exp_gate_up", fused)
        want = [c.matrix("exp_rows", w).raw.view(4, 256, -1) for w in (gate, up)]
        assert got.shape == (4, 512, 256)
        assert torch.equal(got.raw, torch.cat(want, 1).reshape(-1))


@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe", "olmoe", "deepseek2", "deepseek2-qlora", "deepseek2-v3"])
def test_moe_checkpoint_directory_gives_the_converted_files_logits(moe_dirs: Path, family: str) -> None:
    """-m DIR reads the checkpoint as llama.cpp's converter writes it: the same hyperparameters,
    each layer's per-expert FFNs stacked, deepseek2's kv_b split per head and its selection bias
    named exp_probs_b; prefill and decode logits bit-equal to the converted F32 file's."""
    from ubatch.engine.model.model import Model

    out, hps = [], []
    for path in (_gguf(moe_dirs, family, "f32"), moe_dirs / family):
        ctx = _context(path, "cpu", 512)
        hps.append(ctx.model.hparams)
        out.append(_prefill_then_decode(ctx, 3))
    assert hps[0] == hps[1]
    assert torch.equal(out[0], out[1])
    m = Model.load(moe_dirs / family)
    assert m.layers[-1].mat("ffn_down_exps").shape == (m.hparams.moe.n_expert, 256, m.hparams.moe.n_ff_exp)


def test_moe_checkpoint_directories_refused_in_one_line(moe_dirs: Path, tmp_path: Path) -> None:
    """Families whose checkpoints -m DIR does not read (gpt-oss's and Granite MoE's fused experts)
    and a checkpoint missing one expert: one line each, naming what to do or what is missing."""
    from safetensors.torch import load_file, save_file

    from ubatch.engine.errors import ModelLoadError
    from ubatch.engine.model.model import Model

    for family, what in (("gpt-oss", "GPT-OSS"), ("granitemoe", "Granite MoE")):
        with pytest.raises(ModelLoadError) as e:
            Model.load(tiny_families.write_hf(moe_dirs / family, family))
        assert f"does not read {what} checkpoints" in str(e.value) and "convert_hf_to_gguf.py" in str(e.value)
    d = tiny_families.write_hf(moe_dirs / "qwen3moe", "qwen3moe")
    bad = tmp_path / "qwen3moe"
    bad.mkdir()
    for f in ("config.json", "tokenizer.model"):
        (bad / f).write_bytes((d / f).read_bytes())
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match="blk.1.ffn_up_exps.weight takes experts 0-7; expert 5 is missing"):
        Model.load(bad)


def test_expert_slices_are_views_of_the_mapped_file(moe_dirs: Path) -> None:
    """The experts stay as stored: each expert's matrix is a view of the file's bytes."""
    from ubatch.engine.model.model import Model

    m = Model.load(_gguf(moe_dirs, "qwen3moe", "f16"))
    w = m.layers[0].mat("ffn_up_exps")
    assert w.shape == (8, 512, 256) and w.ggml_type == T.F16
    e3 = w.expert(3)
    assert e3.shape == (512, 256) and e3.raw.data_ptr() == w.raw.data_ptr() + 3 * 512 * 256 * 2
    assert np.shares_memory(e3.raw.numpy(), m.gguf.tensors["blk.0.ffn_up_exps.weight"].data)


# olmoe's Q/K norms span every head
@pytest.mark.parametrize("family", [f for f in MOE_NAMES if f != "olmoe"])
def test_moe_family_on_two_ranks_gives_the_single_process_logits(moe_dirs: Path, family: str) -> None:
    """-tp 2 cuts each expert's gate and up by rows and its down by columns (vLLM's default), the
    router whole on every rank, gpt-oss's sinks by head and the biases after a reduction added
    by rank 0 only; deepseek2's latent attention as vLLM cuts it: the compressed row (and its
    cache) whole on every rank, q, k_b and v_b by heads, the output by their columns: prefill
    and decode logits equal one process's (an f32 cache)."""
    assert_two_ranks_match(_gguf(moe_dirs, family, "f32"))


def test_fused_gate_up_experts_on_two_ranks_give_the_single_process_logits(moe_dirs: Path) -> None:
    """-tp 2 on a deepseek2 file with ffn_gate_up_exps: each rank's halves of each expert."""
    src = _gguf(moe_dirs, "deepseek2-v3", "f32")
    fused = moe_dirs / "deepseek2-v3.f32.gate_up.gguf"
    if not fused.exists():
        tiny_families.rewrite_gguf(src, fused, tensors=tiny_families.fuse_gate_up_exps)
    assert_two_ranks_match(fused)


def test_info_shows_total_and_active_weights_and_the_expert_tensors(moe_dirs: Path) -> None:
    """`ubatch info --json`: the experts' share of the weights, what one token reads (2 of 8
    experts), and each layer's router and expert tensors in the compute buffer; the plan from
    shapes alone equals the real context's."""
    import json

    from cli_inproc import run_cli

    from ubatch.engine.context.context import Context
    from ubatch.engine.context.report import memory_plan, plan_for
    from ubatch.engine.model.model import Model
    from ubatch.engine.params import ContextParams

    path = _gguf(moe_dirs, "qwen3moe", "f16")
    r = run_cli(["info", "-m", str(path), "-c", "1024", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    moe = d["moe"]
    experts = 2 * 3 * 8 * 512 * 256 * 2  # layers x (gate, up, down) x experts x FFN x n_embd x f16
    assert (moe["n_expert"], moe["n_expert_used"], moe["expert_bytes"]) == (8, 2, experts)
    assert moe["active_bytes"] == d["model_bytes"] - experts + experts // 4
    names = [t["name"] for t in moe["compute"]]
    assert names[:3] == ["ffn_moe_logits-0", "ffn_moe_topk-0", "ffn_moe_weights-0"]
    assert {"ffn_moe_gate-0", "ffn_moe_up-0", "ffn_moe_down-0", "ffn_moe_out-0"} <= set(names)
    gate = next(t for t in moe["compute"] if t["name"] == "ffn_moe_gate-0")
    assert gate["shape"] == [512, 2, 512] and gate["bytes"] == 512 * 2 * 512 * 4
    m = Model.load(path)
    params = ContextParams(n_ctx=1024)
    assert plan_for(m, params) == memory_plan(Context(m, params))


def test_latent_attention_cache_holds_one_compressed_row_per_token(moe_dirs: Path) -> None:
    """deepseek2's KV cache is K only, kv_lora_rank + RoPE dims per cell and layer, as llama.cpp
    sizes it: in `info --json`, the plan table and the startup log; and a K-shift rotates only
    the row's RoPE part (the shifted sequence's next logits equal a fresh prefill's at the new
    positions)."""
    import json

    from cli_inproc import run_cli

    path = _gguf(moe_dirs, "deepseek2", "f16")
    r = run_cli(["info", "-m", str(path), "-c", "1024", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["mla"]["cell_values"], d["mla"]["mha_values"]) == (128 + 32, 4 * (96 + 64))
    assert [(c["k_bytes"], c["v_bytes"]) for c in d["kv"]] == [(1024 * 2 * 160 * 2, 0)]  # cells x layers x row x f16
    from ubatch.cli.memory_view import llama_lines
    from ubatch.engine.context.report import plan_for
    from ubatch.engine.generation.generation import shift_sequence
    from ubatch.engine.model.model import Model
    from ubatch.engine.params import ContextParams

    lines = llama_lines(plan_for(Model.load(path), ContextParams(n_ctx=1024)))
    assert any("K only, 128 latent + 32 RoPE = 160 values per cell and layer" in line for line in lines)

    ctx = _context(path, "cpu", 512)
    ctx.decode(Batch.from_tokens(SEQ[:40], 0))
    shift_sequence(ctx.memory, 0, 40, 4, 10)  # keep 4, drop the next 10: 30 cells at positions 0..29
    before = ctx.memory.caches[0].k[0].data.clone()
    ctx.memory.update(ctx.model.hparams, ctx.ops, ctx.rope_freqs)
    fresh = _context(path, "cpu", 512)
    fresh.decode(Batch.from_tokens(SEQ[:4] + SEQ[14:40], 0))
    got, ref = ctx.memory.caches[0], fresh.memory.caches[0]  # layer 0: deeper ones saw the dropped tokens
    cells = np.flatnonzero(got.streams[0].pos >= 0)
    order = cells[np.argsort(got.streams[0].pos[cells])]
    moved = order[4:]
    assert torch.equal(got.k[0].data[moved, :, :128], before[moved, :, :128])  # the latent as it was
    assert not torch.equal(got.k[0].data[moved, :, 128:], before[moved, :, 128:])  # the RoPE part re-rotated
    torch.testing.assert_close(got.k[0].data[order], ref.k[0].data[:30], atol=1e-5, rtol=1e-5)


def test_latent_attention_on_the_cuda_backend(moe_dirs: Path) -> None:
    """deepseek2 on the cuda backend (Triton's interpreter without a GPU): the per-head k_b / v_b
    products through the expert kernel, attention over the one compressed row (V = K);
    prefill and decode steps against transformers."""
    ids = SEQ[:7]
    ctx = _context(_gguf(moe_dirs, "deepseek2", "f32"), "cuda", 512)
    ctx.decode(Batch.from_tokens(ids[:6], 0, all_logits=True))
    rows = [ctx.logits.clone()]
    for i in range(6, 7):
        ctx.decode(Batch.from_tokens(ids[i : i + 1], i))
        rows.append(ctx.logits.clone())
    kld, top1 = _kld_top1(_reference("deepseek2", ids), torch.cat(rows).cpu())
    assert top1 == 1.0 and kld <= 1e-4, (kld, top1)
