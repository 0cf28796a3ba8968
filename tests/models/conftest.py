"""Fixtures of the model tests: the tiny hybrid families as (name, our model, transformers model)."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import HYBRID_FAMILIES, load_ours, save_tiny


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def family(request, tmp_path_factory):
    """(family, our model, transformers model) on the same tiny random float32 checkpoint."""
    folder = str(tmp_path_factory.mktemp(request.param))
    ref = save_tiny(request.param, folder)
    ours, _ = load_ours(folder, max_model_len=256)
    return request.param, ours, ref
