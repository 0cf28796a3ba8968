"""RoPE scaling types beyond default / linear / llama3: yarn, longrope and dynamic NTK.

Unit: our inverse frequencies and attention factor, read through our config layer from transformers'
own config, against transformers' ``ROPE_INIT_FUNCTIONS`` for several parameter sets; longrope's and
dynamic's per-position table against transformers' frequencies for a forward of length p + 1. End to end:
tiny random Llama / Qwen2 (yarn), Phi-3 (longrope) and Llama (dynamic) checkpoints against transformers,
logits within the shared float32 tolerance and greedy tokens identical, each with small original lengths
so the scaling changes the result (asserted: the same weights without the scaling do not match).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.fixtures.checkpoints import LLM_SHAPE, hf_config, load_ours, save_tiny
from tests.fixtures.llm import check_greedy_parity, generate_greedy, hf_generate_greedy, make_llm
from tests.fixtures.paged_runner import PagedRunner, assert_close_logits, hf_logits
from tokenos.layers.rotary import rope_angles, rope_attention_factor, rope_inv_freq
from tokenos.models.config import derived_max_model_len, rope_for_layer_type

HEAD_DIM = 16  # TINY's
HALF = HEAD_DIM // 2


def _yarn(factor: float | None, original: int, **fields) -> dict:
    return {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": factor,
        "original_max_position_embeddings": original,
    } | fields


def _longrope(short: list[float], long: list[float], **fields) -> dict:
    return {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": short, "long_factor": long} | fields


def _dynamic(factor: float, theta: float = 1e4) -> dict:
    return {"rope_type": "dynamic", "factor": factor, "rope_theta": theta}


def _case(family: str, rope: dict, max_len: int | None = None, original: int | None = None):
    """(family, transformers config overrides): the rope parameters, max_position_embeddings and (Phi-3's
    top-level) original_max_position_embeddings."""
    overrides = {"rope_parameters": rope}
    if max_len is not None:
        overrides["max_position_embeddings"] = max_len
    if original is not None:
        overrides["original_max_position_embeddings"] = original
    return family, overrides


SHORT = [1.0 + 0.05 * i for i in range(HALF)]
LONG = [1.5 + 0.6 * i for i in range(HALF)]

# Per case transformers computes from the config object, we from its saved dict (our config layer).
YARN_CASES = {
    "qwen_recipe": _case("qwen2", _yarn(4.0, 32), max_len=128),
    "betas_no_truncate": _case("llama", _yarn(8.0, 64, beta_fast=16, beta_slow=2, truncate=False)),
    "deepseek_mscale": _case("llama", _yarn(16.0, 32, mscale=0.707, mscale_all_dim=0.707), max_len=512),
    "mscale_ratio": _case("llama", _yarn(4.0, 64, mscale=1.0, mscale_all_dim=0.5)),
    "explicit_attention_factor": _case("qwen3", _yarn(2.0, 128, attention_factor=0.9)),
    "null_factor_is_length_ratio": _case("llama", _yarn(None, 64), max_len=256),
    "theta_1e6": _case("mistral", _yarn(4.0, 64, rope_theta=1e6)),
}
LONGROPE_CASES = {
    "phi3_top_level_original": _case("phi3", _longrope(SHORT, LONG), max_len=128, original=32),
    "explicit_factor": _case("phi3", _longrope(SHORT, LONG, factor=2.0), max_len=128, original=32),
    "explicit_attention_factor": _case(
        "phi3", _longrope(SHORT, LONG, attention_factor=1.3), max_len=256, original=64
    ),
    "swapped_factors_original_16": _case("phi3", _longrope(LONG, SHORT), max_len=128, original=16),
    "llama_longrope": _case(
        "llama", _longrope(SHORT, LONG, original_max_position_embeddings=32), max_len=128
    ),
}
DYNAMIC_CASES = {
    "factor_2": _case("llama", _dynamic(2.0), max_len=32),
    "factor_1_7_theta_5e5": _case("qwen2", _dynamic(1.7, 5e5), max_len=48),
}


def _both(family: str, overrides: dict):
    """(transformers config, our (theta, scaling) read from its saved dict)."""
    config = hf_config(family, **overrides)
    return config, rope_for_layer_type(config.to_dict(), "full_attention")


def _theirs(config, rope_type: str, seq_len=None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_matches_transformers(case):
    config, (theta, scaling) = _both(*YARN_CASES[case])
    inv_freq, attention_factor = _theirs(config, "yarn")
    _assert_same(rope_inv_freq(HEAD_DIM, theta, scaling), inv_freq)
    assert rope_attention_factor(scaling) == pytest.approx(attention_factor, rel=1e-12)
    # Guard against a vacuous comparison: yarn really moved some frequencies and the mscale (bar the
    # explicit one-and-only ratio of equal mscales).
    assert not torch.equal(inv_freq, rope_inv_freq(HEAD_DIM, theta, None))


@pytest.mark.parametrize("case", list(LONGROPE_CASES))
def test_longrope_matches_transformers_short_and_long(case):
    config, (theta, scaling) = _both(*LONGROPE_CASES[case])
    original = scaling["original_max_position_embeddings"]
    assert original == config.rope_parameters["original_max_position_embeddings"]
    for seq_len in (None, original, original + 1, 4 * original):
        inv_freq, attention_factor = _theirs(config, "longrope", seq_len)
        _assert_same(rope_inv_freq(HEAD_DIM, theta, scaling, seq_len), inv_freq)
        assert rope_attention_factor(scaling) == pytest.approx(attention_factor, rel=1e-12)
    assert rope_attention_factor(scaling) != 1.0


@pytest.mark.parametrize("case", list(DYNAMIC_CASES))
def test_dynamic_matches_transformers_within_and_beyond(case):
    config, (theta, scaling) = _both(*DYNAMIC_CASES[case])
    max_len = config.max_position_embeddings
    inside, _ = _theirs(config, "dynamic")  # at init: what every forward within max_len uses
    _assert_same(rope_inv_freq(HEAD_DIM, theta, scaling), inside)
    _assert_same(rope_inv_freq(HEAD_DIM, theta, scaling, max_len), inside)
    for seq_len in (max_len + 1, 2 * max_len):
        # transformers' forward passes max(position_ids) + 1 as a tensor
        beyond, factor = _theirs(config, "dynamic", torch.tensor(seq_len))
        _assert_same(rope_inv_freq(HEAD_DIM, theta, scaling, seq_len), beyond)
        assert factor == rope_attention_factor(scaling) == 1.0
        assert not torch.equal(beyond, inside)


@pytest.mark.parametrize("case", ["phi3_top_level_original", "llama_longrope", "dynamic:factor_2"])
def test_table_row_p_is_a_forward_of_length_p_plus_one(case):
    """Longrope and dynamic: every row of our one table is transformers' frequencies for seq_len p + 1."""
    name = case.removeprefix("dynamic:")
    family, overrides = DYNAMIC_CASES[name] if case.startswith("dynamic:") else LONGROPE_CASES[name]
    config, (theta, scaling) = _both(family, overrides)
    rope_type = scaling["rope_type"]
    length = 3 * config.max_position_embeddings if rope_type == "dynamic" else config.max_position_embeddings
    angles = rope_angles(HEAD_DIM, length, theta, scaling)
    for p in (0, 5, 31, 32, 33, length - 1):
        seq_len = torch.tensor(p + 1) if rope_type == "dynamic" else p + 1
        inv_freq, _ = _theirs(config, rope_type, seq_len)
        _assert_same(angles[p], p * inv_freq)


def test_llama3_and_linear_still_match_transformers():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3 |= {"original_max_position_embeddings": 32, "rope_theta": 5e5}
    for params in (llama3, {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}):
        config, (theta, scaling) = _both("llama", dict(rope_parameters=params))
        inv_freq, factor = _theirs(config, params["rope_type"])
        _assert_same(rope_inv_freq(HEAD_DIM, theta, scaling), inv_freq)
        assert rope_attention_factor(scaling) == factor == 1.0


def test_phi3_su_and_yarn_names_mean_longrope_elsewhere_yarn():
    """Older Phi-3 configs (rope_scaling "su" / "yarn" with short and long factors) read as longrope."""
    cfg = {"model_type": "phi3", "max_position_embeddings": 128, "original_max_position_embeddings": 32}
    for name in ("su", "yarn"):
        cfg["rope_scaling"] = {"type": name, "short_factor": SHORT, "long_factor": LONG}
        scaling = rope_for_layer_type(cfg, "full_attention")[1]
        assert scaling["rope_type"] == "longrope" and scaling["factor"] == 4.0
    cfg["model_type"] = "llama"  # a Llama "yarn" is yarn, and this one lacks its factor
    with pytest.raises(ValueError, match="'yarn' needs rope_parameters field"):
        rope_for_layer_type(cfg, "full_attention")


@pytest.mark.parametrize(
    "params,match",
    [
        (
            {"rope_type": "yarn", "original_max_position_embeddings": 32},
            "needs rope_parameters field.*factor",
        ),
        ({"rope_type": "longrope", "short_factor": SHORT}, "needs rope_parameters field.*long_factor"),
        ({"rope_type": "dynamic"}, "needs rope_parameters field.*factor"),
        ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor, high_freq_factor"),
        ({"rope_type": "mrope"}, "Unsupported rope_type 'mrope'"),
    ],
)
def test_unsupported_or_incomplete_scaling_is_refused(params, match):
    cfg = {"max_position_embeddings": 128, "rope_parameters": params}
    with pytest.raises(ValueError, match=match):
        rope_for_layer_type(cfg, "full_attention")


def test_longrope_factor_count_must_fit_the_rotary_dim():
    scaling = rope_for_layer_type(
        {"max_position_embeddings": 64, "rope_parameters": _longrope(SHORT, LONG)}, "x"
    )[1]
    with pytest.raises(ValueError, match="short_factor has 8 entries; rotary dim 8 needs 4"):
        rope_inv_freq(8, 1e4, scaling)


def test_max_model_len_follows_vllm():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert derived_max_model_len(40960, yarn) == 131072  # Qwen3's recipe
    assert derived_max_model_len(64, {"rope_type": "dynamic", "factor": 2.0}) == 128
    for scaling in (None, {"rope_type": "longrope"}, {"rope_type": "llama3"}, {"rope_type": "linear"}):
        assert derived_max_model_len(131072, scaling) == 131072


# ---------------------------------------------------------------- end to end against transformers

# Original length 32 of 128 (dynamic: 32, grown to 64): prompts and generations well past it.
E2E = {
    "llama_yarn": _case("llama", _yarn(4.0, 32), max_len=128),
    "qwen2_yarn": _case("qwen2", _yarn(4.0, 32, beta_fast=8), max_len=128),
    "phi3_longrope": _case("phi3", _longrope(SHORT, LONG), max_len=128, original=32),
    "llama_longrope": _case(
        "llama", _longrope(SHORT, LONG, original_max_position_embeddings=32), max_len=128
    ),
    "llama_dynamic": _case("llama", _dynamic(2.0), max_len=32),
}
PROMPT = [(i * 37 + 11) % 120 + 3 for i in range(30)]  # within every case's original length (32)


def _checkpoint(tmp_path, name: str):
    """(name, folder, transformers reference) of the E2E case `name`, unperturbed (greedy-stable)."""
    family, overrides = E2E[name]
    folder = str(tmp_path / name)
    return name, folder, save_tiny(family, folder, perturbed=False, **{**LLM_SHAPE, **overrides})


@pytest.fixture(params=list(E2E))
def e2e(request, tmp_path):
    return _checkpoint(tmp_path, request.param)


def _without_scaling(folder: str, dest: str) -> str:
    """A copy of the checkpoint whose config has default rope (same weights, same theta)."""
    os.makedirs(dest)
    for name in os.listdir(folder):
        os.symlink(os.path.join(folder, name), os.path.join(dest, name))
    os.remove(os.path.join(dest, "config.json"))
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dest


def _prefill_logits(folder: str, tokens: list[int]) -> torch.Tensor:
    model, config = load_ours(folder)
    runner = PagedRunner(model, block_size=16, max_model_len=config.max_model_len)
    runner.step([(0, tokens)])
    return runner.request_logits(0)


def test_prefill_logits_match_and_the_scaling_matters(e2e, tmp_path):
    name, folder, ref = e2e
    expected = hf_logits(ref, PROMPT)
    ours = _prefill_logits(folder, PROMPT)
    assert_close_logits(ours, expected)
    plain = _prefill_logits(_without_scaling(folder, str(tmp_path / "plain")), PROMPT)
    if name == "llama_dynamic":  # within max_position_embeddings dynamic NTK is the default rope
        assert_close_logits(plain, expected)
    else:
        assert (plain - expected).abs().max() > 1e-2


def _generate(folder: str, ref, prompts: list[list[int]], max_tokens: int) -> None:
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=16, max_model_len=None)
    outputs = generate_greedy(llm, prompts, max_tokens)
    check_greedy_parity(outputs, prompts, lambda prompt: hf_generate_greedy(ref, prompt, max_tokens))


def test_greedy_generation_past_the_original_length_matches(e2e):
    """Prompts within the original length (32), generations well past it: transformers' generate switches
    longrope to its long factors / grows dynamic's base at each decode step, as our table does per
    position. Phi-3's generate instead recomputes the whole sequence with long factors at the crossing (the
    documented difference, `tokenos.layers.rotary`), so its sequences stay within the original length."""
    name, folder, ref = e2e
    if name == "phi3_longrope":
        _generate(folder, ref, [PROMPT[:5], PROMPT[:17]], max_tokens=15)  # the last forward at position 31
        return
    _generate(folder, ref, [PROMPT[:5], PROMPT[:17], PROMPT], max_tokens=30)


@pytest.mark.parametrize("name", ["llama_yarn", "qwen2_yarn"])
def test_yarn_long_prompts_match(tmp_path, name):
    """yarn is length-independent: prompts longer than the original length (chunked) match too."""
    _, folder, ref = _checkpoint(tmp_path, name)
    prompts = [[(i * 29 + r) % 250 + 3 for i in range(60 + 7 * r)] for r in range(2)]
    _generate(folder, ref, prompts, max_tokens=10)


@torch.no_grad()
def _hf_token_by_token_logits(ref, tokens: list[int]) -> torch.Tensor:
    """transformers' logits of every position, fed one token at a time through its KV cache."""
    out, past, rows = None, None, []
    for t in tokens:
        out = ref(torch.tensor([[t]]), cache=past, use_cache=True)
        past = out.past_key_values
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["phi3_longrope", "llama_longrope", "llama_dynamic"])
def test_long_prompt_is_transformers_token_by_token(tmp_path, name):
    """The documented difference: a prompt longer than the original length in one forward. transformers
    then rotates the whole forward with longrope's long factors (dynamic: the base for the full length);
    we give each position what a forward ending there gets, i.e. transformers fed token by token."""
    _, folder, ref = _checkpoint(tmp_path, name)
    tokens = [(i * 31 + 7) % 250 + 3 for i in range(48)]
    ours = _prefill_logits(folder, tokens)
    assert_close_logits(ours, _hf_token_by_token_logits(ref, tokens))
    assert (ours - hf_logits(ref, tokens)).abs().max() > 1e-2  # transformers' one-forward result differs
