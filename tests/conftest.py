"""Shared fixtures: the default model (assembled from its PyPI package) and tiny test models."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from ubatch.engine.default_model import default_model_path as get

    return get()


import sys

sys.path.insert(0, str(Path(__file__).parent))  # tests import their helpers (tiny_models, tiny_vocab)


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import TinySpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-gemma3.gguf", TinySpec())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import TinySpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama.gguf", TinySpec(arch="llama"))
