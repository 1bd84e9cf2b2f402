"""LoRA adapters: tiny random PEFT adapters over a tiny llama checkpoint, as PEFT saves them and as
llama.cpp's convert_lora_to_gguf.py converts them, against transformers + PEFT's own forward."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import tiny_families
import tiny_lora
import torch

from ubatch.engine.batch import Batch
from ubatch.engine.context.context import Context
from ubatch.engine.errors import ContextError, ModelLoadError
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


def test_rows_of_one_ubatch_each_apply_their_own_adapter(files: dict[str, Path]) -> None:
    """Four sequences in one ubatch (base, adapter 1, adapter 2, adapter 1 at 0.5): each row
    gathers its own adapter's product; each sequence's logits are those it gets alone."""
    model = Model.load(files["f32"])
    model.load_adapter(files["lora1.f32"])
    model.load_adapter(files["lora2.f32"])
    sets: list[dict[int, float]] = [{}, {0: 1.0}, {1: 1.0}, {0: 0.5}]
    alone = []
    for s in sets:
        ctx = _context(model)
        ctx.set_adapters(s)
        alone.append(_logits(ctx, SEQ[:16]))
    ctx = _context(model, n_seq=4)
    for seq, s in enumerate(sets):
        ctx.set_seq_adapters(seq, s)
    b = Batch(
        token=SEQ[:16] * 4,
        pos=list(range(16)) * 4,
        seq_id=[[s] for s in range(4) for _ in range(16)],
        logits=[True] * 64,
    )
    ctx.decode(b)
    assert len(ctx.records) == 1
    assert ctx.records[0].loras == {1: ((0, 1.0),), 2: ((1, 1.0),), 3: ((0, 0.5),)}
    for seq in range(4):
        torch.testing.assert_close(ctx.logits[seq * 16 : (seq + 1) * 16], alone[seq], atol=2e-4, rtol=1e-4)


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
