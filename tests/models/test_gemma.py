"""Gemma 2 and Gemma 3 (text) beyond the shared dense parity cases (tests/models/test_parity.py): greedy
parity with transformers through `LLM` under a small chunked-prefill budget and over prefix-cache hits
whose prompts cross the sliding window, the two KV-cache groups (sliding and full), the config layer's
Gemma layouts, and the soft-capped attention path (no C kernel, the same numbers in bf16 as float32 up to
rounding)."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import LLM_SHAPE, load_ours, save_tiny
from tests.fixtures.llm import DENSE, make_llm
from tests.fixtures.paged_runner import PagedRunner, assert_close_logits
from tokenos.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec

FAMILIES = ("gemma2", "gemma3_text")
WINDOW = 8  # _DENSE_EXTRA's sliding_window: every test prompt crosses it
PROMPT = [(i * 37 + 11) % 120 + 3 for i in range(45)]


@pytest.fixture(scope="module", params=FAMILIES)
def gemma(request, tmp_path_factory):
    """(family, folder, transformers reference) of an unperturbed LLM_SHAPE checkpoint."""
    folder = str(tmp_path_factory.mktemp(request.param))
    return request.param, folder, save_tiny(request.param, folder, perturbed=False, **LLM_SHAPE)


def test_greedy_parity_chunked_prefill(gemma):
    _, folder, ref = gemma
    prompts = DENSE.prompts(3, 5, 40, seed=13)
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=8)  # every prompt over several chunks
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)


def test_prefix_cache_hits_across_the_window_keep_parity(gemma):
    _, folder, ref = gemma
    shared = DENSE.prompts(1, 40, 40, seed=7)[0]  # 40 tokens: 5 windows, 2.5 blocks of 16
    prompts = [shared + tail for tail in DENSE.prompts(3, 1, 12, seed=8)] + [shared]
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=32)
    first = DENSE.run(llm, prompts)
    DENSE.check(first, prompts, ref)
    again = DENSE.run(llm, prompts)
    DENSE.check(again, prompts, ref)
    assert all(o.num_cached_tokens >= 32 for o in again), [o.num_cached_tokens for o in again]


def test_two_kv_cache_groups(gemma):
    family, folder, _ = gemma
    llm = make_llm(folder, block_size=16)
    groups = llm.engine.kv_cache_config.kv_cache_groups
    by_kind = {type(g.kv_cache_spec): g for g in groups}
    assert len(groups) == 2 and set(by_kind) == {SlidingWindowSpec, FullAttentionSpec}, groups
    assert by_kind[SlidingWindowSpec].kv_cache_spec.sliding_window == WINDOW
    assert by_kind[SlidingWindowSpec].layer_names == ["model.layers.0.self_attn.attn"]
    assert by_kind[FullAttentionSpec].layer_names == ["model.layers.1.self_attn.attn"]


def test_model_layout(make_checkpoint):
    """Gemma 2 soft-caps only its attention (every layer) and logits; Gemma 3 has per-head q / k norms and
    one rotary table per layer type (its own base on the sliding layers, linear scaling on the full)."""
    from tokenos.layers.rotary import rope_inv_freq

    g2, _ = load_ours(make_checkpoint("gemma2")[0])
    assert [layer.self_attn.attn.logit_softcap for layer in g2.stack.layers] == [3.0, 3.0]
    assert g2.final_logit_softcap == 5.0 and g2.lm_head.tied
    assert g2.stack.layers[0].self_attn.attn.scale == pytest.approx(24**-0.5)
    g3, config = load_ours(make_checkpoint("gemma3_text")[0])
    assert config.layer_sliding_windows == (WINDOW, None) and config.qk_norm
    assert g3.final_logit_softcap is None and g3.stack.layers[0].self_attn.attn.logit_softcap is None
    sliding, full = (layer.self_attn.rotary for layer in g3.stack.layers)
    assert sliding is not full
    expected = torch.outer(torch.arange(4.0), rope_inv_freq(16, 1000.0, None)).cos()
    torch.testing.assert_close(sliding.cos_cache[:4], expected)
    expected = torch.outer(
        torch.arange(4.0), rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 2.0})
    )
    torch.testing.assert_close(full.cos_cache[:4], expected.cos())


def test_config_without_layer_types():
    """Older configs: transformers' default patterns, and Gemma 3's rope_local_base_freq / rope_scaling."""
    from tokenos.models.config import _sliding_windows_from_hf, rope_for_layer_type

    cfg = {"num_hidden_layers": 4, "sliding_window": 16}
    assert _sliding_windows_from_hf(cfg, "Gemma2ForCausalLM") == (16, (16, None, 16, None))
    cfg = {"num_hidden_layers": 7, "sliding_window": 16, "sliding_window_pattern": 3}
    assert _sliding_windows_from_hf(cfg, "Gemma3ForCausalLM")[1] == (16, 16, None, 16, 16, None, 16)
    cfg = {
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    assert rope_for_layer_type(cfg, "sliding_attention") == (1e4, None)
    assert rope_for_layer_type(cfg, "full_attention") == (1e6, {"rope_type": "linear", "factor": 8.0})


def test_softcap_runs_the_c_kernels(make_checkpoint, monkeypatch):
    """Soft-capped layers reach the C decode kernel (and, in bf16 on AVX512-BF16, the prefill kernel), and
    Gemma 2 in bf16 stays close to float32."""
    from tokenos.layers import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    calls = set()
    for name in ("paged_decode", "paged_prefill"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(
            cpu_kernels, name, lambda *a, _r=real, _n=name, **kw: calls.add(_n) or _r(*a, **kw)
        )
    folder, _ = make_checkpoint("gemma2")
    logits = []
    for dtype in ("float32", "bfloat16"):
        model, _ = load_ours(folder, dtype=dtype)
        runner = PagedRunner(model, block_size=16)
        runner.step([(0, PROMPT[:30])])
        for token in PROMPT[30:33]:
            runner.step([(0, [token])])
        logits.append(runner.request_logits(0))
    assert_close_logits(logits[1], logits[0], rel=0.1)
    assert "paged_decode" in calls
    attn = model.stack.layers[0].self_attn.attn
    if cpu_kernels.prefill_supported(attn.num_heads, attn.num_kv_heads, attn.head_size):
        assert "paged_prefill" in calls
