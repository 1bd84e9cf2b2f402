"""The architecture registry (engine/model/archs): each module's declarations, and that nothing
else in the engine branches on an architecture."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ubatch.engine.model.archs import ARCHS, HF_MODEL_TYPES
from ubatch.engine.model.archs.base import HParams

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
    }
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
    for t in specs:
        if t.cut in rows:
            assert t.shape[0] == rows[t.cut], t
        elif t.cut in cols:
            assert t.kind == "matrix" and t.shape[1] == cols[t.cut], t
        else:
            assert t.cut == "replicated" and t.kind in ("vector", "matrix"), t


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
    with pytest.raises(Exception, match="not supported; ubatch runs llama, gemma3"):
        from ubatch.engine.model.hparams import hparams_from_metadata

        hparams_from_metadata({"general.architecture": "mamba"}, "f.gguf")
