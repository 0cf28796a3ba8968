"""OLMo 2 and Phi-3 beyond the shared dense parity cases (tests/models/test_parity.py): Phi-3's partial
rotary really is partial, rope types other than default / longrope are refused, and both families (and
Granite, with its muP multipliers) generate transformers' greedy tokens through `LLM` under a small
chunked-prefill budget."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import LLM_SHAPE, load_ours, save_tiny
from tests.fixtures.llm import DENSE, make_llm


def test_phi3_partial_rotary_dim(make_checkpoint):
    folder, _ = make_checkpoint("phi3", partial_rotary_factor=0.5)
    model, config = load_ours(folder)
    assert model.stack.rotary.rotary_dim == config.head_dim // 2


def test_phi3_refuses_rope_types_transformers_refuses(make_checkpoint):
    """Phi-3 takes default and longrope (tests/models/test_rope_scaling.py); any other type is refused when
    the model is built, as transformers' Phi3Config refuses it."""
    from tokenos.models import load_model_config
    from tokenos.models.phi3 import Phi3ForCausalLM

    config = load_model_config(make_checkpoint("phi3")[0], dtype="float32")
    config.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="Phi3: rope_type 'linear' is not one of default, longrope"):
        Phi3ForCausalLM(config)


@pytest.mark.parametrize(
    "family,overrides", [("olmo2", {}), ("phi3", {"partial_rotary_factor": 0.5}), ("granite", {})]
)
def test_greedy_parity_chunked_prefill(tmp_path, family, overrides):
    folder = str(tmp_path / family)
    ref = save_tiny(family, folder, perturbed=False, **LLM_SHAPE, **overrides)
    prompts = DENSE.prompts(3, 5, 40, seed=13)
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=8)  # every prompt over several chunks
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
