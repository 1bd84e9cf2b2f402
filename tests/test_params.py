"""-c -b -ub -np derive exactly as llama.cpp derives them, and the KV caches get its sizes.

Every row of llama-completion's and llama-server's measured startup figures on the default model
(tests/refdata/lcpp_memory_grid.json, lcpp_server_memory.json) is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ubatch.engine.errors import ContextError
from ubatch.engine.gguf.file import open_gguf
from ubatch.engine.kv.memory import KVMemory
from ubatch.engine.model.hparams import HParams, hparams_from_metadata
from ubatch.engine.params import ContextParams, derive

REF = Path(__file__).parent / "refdata"
MiB = 1024 * 1024
GRID = json.loads((REF / "lcpp_memory_grid.json").read_text())
SERVER = json.loads((REF / "lcpp_server_memory.json").read_text())


@pytest.fixture(scope="module")
def hp(default_model_path: Path) -> HParams:
    return hparams_from_metadata(open_gguf(default_model_path).metadata)


def server_params(r: dict) -> ContextParams:
    """llama-server: -np auto = 4 slots + unified KV; n_outputs_max = n_parallel."""
    np_, kvu = (4, True) if r["np"] == "auto" else (r["np"], bool(r["kvu"]))
    return ContextParams(n_ctx=r["c"], n_batch=2048, n_ubatch=r["ub"], n_seq_max=np_, kv_unified=kvu, n_outputs_max=np_)


def check_kv(mem: KVMemory, expected: list[dict]) -> None:
    infos = [c.info() for c in mem.caches]
    assert len(infos) == len(expected)
    for i, e in zip(infos, expected):
        assert i.size == e["cells"] and i.n_layer == e["layers"]
        assert f"{i.n_seq_max}/{i.n_stream}" == e["seqs"]
        assert (i.k_bytes + i.v_bytes) / MiB == pytest.approx(e["mib"], abs=0.005)
        if "k_mib" in e:
            assert (i.k_bytes / MiB, i.v_bytes / MiB) == pytest.approx((e["k_mib"], e["v_mib"]), abs=0.005)


@pytest.mark.parametrize("r", GRID, ids=lambda r: f"c{r['c']}-b{r['b']}-ub{r['ub']}-np{r['np']}-fa{r['fa']}")
def test_completion_grid(hp: HParams, r: dict) -> None:
    cp = derive(
        ContextParams(n_ctx=r["c"], n_batch=r["b"], n_ubatch=r["ub"], n_seq_max=r["np"], kv_unified=r["kvu"]), hp
    )
    assert (cp.n_seq_max, cp.n_ctx, cp.n_ctx_seq, cp.n_batch, cp.n_ubatch) == (
        r["eff_n_seq_max"],
        r["eff_n_ctx"],
        r["eff_n_ctx_seq"],
        r["eff_n_batch"],
        r["eff_n_ubatch"],
    )
    assert [w for w in cp.warnings if "divisible" in w] == r["warnings"]
    check_kv(KVMemory.build(hp, cp), r["kv"])


@pytest.mark.parametrize("r", SERVER, ids=lambda r: f"c{r['c']}-ub{r['ub']}-np{r['np']}-kvu{r['kvu']}")
def test_server_grid(hp: HParams, r: dict) -> None:
    cp = derive(server_params(r), hp)
    assert (
        str(cp.n_seq_max),
        str(cp.n_ctx),
        str(cp.n_ctx_seq),
        str(cp.n_batch),
        str(cp.n_ubatch),
        str(cp.n_outputs_max),
        str(cp.kv_unified).lower(),
    ) == (
        r["eff_n_seq_max"],
        r["eff_n_ctx"],
        r["eff_n_ctx_seq"],
        r["eff_n_batch"],
        r["eff_n_ubatch"],
        r["eff_n_outputs_max"],
        r["eff_kv_unified"],
    )
    check_kv(KVMemory.build(hp, cp), r["kv"])


def test_batch_is_clamped_with_the_unpadded_context(hp: HParams) -> None:
    cp = derive(ContextParams(n_ctx=100), hp)
    assert (cp.n_ctx, cp.n_batch, cp.n_ubatch) == (256, 100, 100)


def test_ubatch_zero_means_batch_and_never_exceeds_it(hp: HParams) -> None:
    assert derive(ContextParams(n_ctx=4096, n_batch=1024, n_ubatch=0), hp).n_ubatch == 1024
    assert derive(ContextParams(n_ctx=4096, n_batch=64, n_ubatch=512), hp).n_ubatch == 64


def test_zero_context_is_the_training_context(hp: HParams) -> None:
    cp = derive(ContextParams(n_ctx=0, n_seq_max=4), hp)
    assert (cp.n_ctx, cp.n_ctx_seq) == (32768, 8192)


def test_kv_types_scale_the_cache(hp: HParams) -> None:
    def mib(t: str) -> float:
        cp = derive(ContextParams(n_ctx=4096, type_k=t, type_v=t), hp)
        return sum(c.info().k_bytes + c.info().v_bytes for c in KVMemory.build(hp, cp).caches) / MiB

    assert mib("f16") == pytest.approx(27.0)  # 3 x 4096 + 15 x 1024 cells x 512 values x 2 B
    assert mib("f32") == pytest.approx(54.0)
    assert mib("q8_0") == pytest.approx(27.0 * 34 / 64)
    assert mib("q4_0") == pytest.approx(27.0 * 18 / 64)


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(n_batch=0, n_ubatch=0), "cannot both be zero"),
        (dict(n_seq_max=257), "n_seq_max"),
        (dict(type_k="q5_k"), "KV cache type"),
    ],
)
def test_bad_parameters_are_refused(hp: HParams, kw: dict, msg: str) -> None:
    with pytest.raises(ContextError, match=msg):
        derive(ContextParams(**kw), hp)
