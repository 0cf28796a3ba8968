"""Our dense models vs transformers on the same tiny random weights, over the engine's paged pool
(`tests.fixtures.paged_runner.PagedRunner`, the runner of the hybrid tests too, with shuffled blocks)."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import load_ours
from tests.fixtures.paged_runner import PagedRunner, assert_close_logits, hf_logits
from tokenos.config import CacheConfig

CASES = {
    "llama_gqa_untied": ("llama", {}),
    "llama_tied_mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama3_rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "qwen2_bias": ("qwen2", {}),
    "qwen2_sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3_qk_norm": ("qwen3", {"tie_word_embeddings": True}),
    "mistral_sliding": ("mistral", {"sliding_window": 8}),
    "olmo2_post_norm": ("olmo2", {}),
    "phi3_fused": ("phi3", {}),
    "phi3_partial_rotary_tied": ("phi3", {"partial_rotary_factor": 0.5, "tie_word_embeddings": True}),
    "granite_mup": ("granite", {}),
    "granite_mup_tied_bias": ("granite", {"tie_word_embeddings": True, "attention_bias": True}),
    # MoE layer + dense layer each (checkpoints.py's _DENSE_EXTRA); the variants flip norm_topk_prob,
    # swap which layer is sparse, drop Qwen2-MoE's q/k/v bias, and give Qwen3-MoE all attention biases.
    "qwen2_moe_shared_expert": ("qwen2_moe", {}),
    "qwen2_moe_norm_topk_no_bias": (
        "qwen2_moe",
        {"norm_topk_prob": True, "qkv_bias": False, "mlp_only_layers": [], "decoder_sparse_step": 2},
    ),
    "qwen3_moe_qk_norm": ("qwen3_moe", {}),
    "qwen3_moe_unnormed_bias_tied": (
        "qwen3_moe",
        {
            "norm_topk_prob": False,
            "attention_bias": True,
            "tie_word_embeddings": True,
            "decoder_sparse_step": 1,
        },
    ),
    # Window 8 on layer 0, full layer 1; Gemma 2 soft-caps scores and logits, Gemma 3 norms q / k and
    # rotates each layer type with its own table (tests/fixtures/checkpoints.py's _DENSE_EXTRA).
    "gemma2_softcap_sliding": ("gemma2", {}),
    "gemma3_text_qk_norm_rope_per_type": ("gemma3_text", {}),
    # Sinks, window 8 on layer 0, biased clamped experts (tests/models/test_gpt_oss.py goes further).
    "gpt_oss_sinks_sliding_moe": ("gpt_oss", {}),
}

PROMPT = [(i * 37 + 11) % 120 + 3 for i in range(45)]


@pytest.fixture(params=list(CASES))
def case(request, make_checkpoint):
    family, overrides = CASES[request.param]
    folder, reference = make_checkpoint(family, **overrides)
    model, config = load_ours(folder)
    return model, config, reference


def test_full_prefill_matches(case):
    model, config, reference = case
    runner = PagedRunner(model, block_size=16)
    runner.step([(0, PROMPT)])
    assert_close_logits(runner.request_logits(0), hf_logits(reference, PROMPT))


@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_then_decode_matches(case, block_size):
    model, config, reference = case
    runner = PagedRunner(model, block_size=block_size, seed=block_size)
    start = 0
    for size in (7, 13, 1, 9):  # odd chunks, one of them a single token
        runner.step([(0, PROMPT[start : start + size])])
        start += size
    for token in PROMPT[start:]:  # the rest as decode steps
        runner.step([(0, [token])])
    assert_close_logits(runner.request_logits(0), hf_logits(reference, PROMPT))


def test_mixed_batch_matches(case):
    """Prefill chunks and decodes of several requests in the same forward, in mixed order."""
    model, config, reference = case
    prompts = {r: [(t * (r + 2) + r) % 125 + 2 for t in PROMPT[: 20 + 7 * r]] for r in range(4)}
    schedule = {0: [5, 9, 1, 1, 1], 1: [12, 1, 1, 3, 1], 2: [1, 17, 2, 1, 1], 3: [26, 1, 1, 12, 1]}
    # 32 blocks: a pool the engine would size for a 64-token context (the longest request has 41).
    runner = PagedRunner(model, block_size=16, num_blocks=32, seed=3, max_model_len=64)
    done = dict.fromkeys(prompts, 0)
    for step in range(5):
        order = [3, 1, 0, 2] if step % 2 else [0, 2, 3, 1]
        work = []
        for r in order:
            n = schedule[r][step]
            work.append((r, prompts[r][done[r] : done[r] + n]))
            done[r] += n
        runner.step(work)
    for r, prompt in prompts.items():
        assert_close_logits(runner.request_logits(r), hf_logits(reference, prompt[: done[r]]))


def test_kv_cache_spec_names_and_windows(case):
    model, config, _ = case
    spec_module = pytest.importorskip("tokenos.core.kv_cache.spec")
    specs = model.get_kv_cache_spec(CacheConfig(block_size=16))
    assert list(specs) == [f"model.layers.{i}.self_attn.attn" for i in range(config.num_hidden_layers)]
    for spec, window in zip(specs.values(), config.layer_sliding_windows, strict=True):
        assert spec.block_size == 16 and spec.head_size == config.head_dim and spec.dtype == "float32"
        expected = spec_module.FullAttentionSpec if window is None else spec_module.SlidingWindowSpec
        assert type(spec) is expected


def test_bfloat16_close_to_float32(make_checkpoint):
    folder, _ = make_checkpoint("llama")
    ours32, config32 = load_ours(folder)
    ours16, config16 = load_ours(folder, dtype="bfloat16")
    assert config16.dtype == torch.bfloat16
    run32 = PagedRunner(ours32, block_size=16)
    run16 = PagedRunner(ours16, block_size=16)
    for runner in (run32, run16):
        runner.step([(0, PROMPT[:30])])
        runner.step([(0, PROMPT[30:31])])
    assert_close_logits(run16.request_logits(0), run32.request_logits(0), rel=0.1)


def test_bfloat16_prefill_kernel_as_close_to_float32_as_the_torch_path(make_checkpoint, monkeypatch):
    """The C prefill kernel (bf16 pages read in place) over chunked prefill, a prefix hit and a mixed
    step: its logits are no further from float32 than those of the torch bf16 path (SDPA)."""
    from tokenos.layers import cpu_kernels
    from tokenos.layers.attention import Attention

    if not cpu_kernels.prefill_supported(4, 2, 16):
        pytest.skip("the C prefill kernel needs AVX512-BF16")
    folder, _ = make_checkpoint("llama")
    ours32, _ = load_ours(folder)
    ours16, _ = load_ours(folder, dtype="bfloat16")

    def run(model, c_prefill: bool | None) -> torch.Tensor:
        if c_prefill is not None:
            monkeypatch.setattr(Attention, "_use_c_prefill", lambda self, q, kv_cache: c_prefill)
        runner = PagedRunner(model, block_size=16)
        runner.step([(0, PROMPT[:20])])
        runner.step([(0, PROMPT[20:45]), (1, PROMPT[:33])])
        runner.step([(0, PROMPT[3:4]), (1, PROMPT[33:45])])
        return torch.cat([runner.request_logits(0), runner.request_logits(1)])

    ref = run(ours32, None)
    fast, slow = run(ours16, True), run(ours16, False)
    assert_close_logits(fast, ref, rel=0.1)
    assert (fast - ref).abs().mean() <= 1.25 * (slow - ref).abs().mean() + 1e-3
