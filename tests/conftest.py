"""Shared fixtures: the default model (assembled from its PyPI package) and tiny test models,
as files and as loaded Model objects shared by every test of the session (a Model is read-only:
each test makes its own Context)."""

from __future__ import annotations

import os

# The C kernels and torch share one OpenMP (libgomp) pool sized to every core. Its default wait
# policy spins at each barrier, so on a machine whose cores are busy with other work a tiny
# model's decode takes tens of milliseconds instead of two. Idle OpenMP threads sleep instead;
# set before torch loads libgomp, and inherited by the CLI subprocesses the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests import their helpers (tiny_models, tiny_vocab)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from ubatch.engine.model.default_model import default_model_path as get

    return get()


@pytest.fixture(scope="session")
def default_model(default_model_path: Path):  # type: ignore[no-untyped-def]
    """Gemma 3 270M loaded once for the session."""
    from ubatch.engine.model.model import Model

    return Model.load(default_model_path)


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import TinySpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-gemma3.gguf", TinySpec())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import TinySpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama.gguf", TinySpec(arch="llama"))


@pytest.fixture(scope="session")
def tiny_gemma_model(tiny_gemma: Path):  # type: ignore[no-untyped-def]
    from ubatch.engine.model.model import Model

    return Model.load(tiny_gemma)


@pytest.fixture(scope="session")
def tiny_llama_model(tiny_llama: Path):  # type: ignore[no-untyped-def]
    from ubatch.engine.model.model import Model

    return Model.load(tiny_llama)
