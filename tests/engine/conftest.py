"""Fixtures of the engine tests: the real SmolLM2 tokenizer, when its package is installed."""

from __future__ import annotations

import pytest

from tests.fixtures.tokenizers import HAS_SMOLLM2, NO_SMOLLM2
from tokenos.engine.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    if not HAS_SMOLLM2:
        pytest.skip(NO_SMOLLM2)
    return load_tokenizer(None)
