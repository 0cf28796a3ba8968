"""Fixtures of the end-to-end `LLM` tests: tiny random float32 checkpoints and their transformers models."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(folder, transformers model): the tiny dense Llama in the LLM tests' shape, unperturbed."""
    folder = str(tmp_path_factory.mktemp("tiny") / "llama")
    return folder, save_tiny("llama", folder, perturbed=False, **LLM_SHAPE)


@pytest.fixture(scope="module", params=["mamba2", "bamba", "qwen3_next", "granitemoehybrid", "falcon_h1"])
def hybrid(request, tmp_path_factory):
    """(folder, transformers model) for each hybrid family: a tiny random float32 checkpoint."""
    folder = str(tmp_path_factory.mktemp(request.param))
    return folder, save_tiny(request.param, folder)
