"""Config validation, KV-cache specs, grouping, page-size unification and pool sizing."""

from __future__ import annotations

import pytest

from tokenos.config import CacheConfig, SchedulerConfig
from tokenos.core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_cache_config,
)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"policy": "lifo"}, "policy"),
        ({"long_prefill_token_threshold": -2}, "long_prefill_token_threshold"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16, "max_model_len": 64}, "chunked"),
    ],
)
def test_scheduler_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 0}, "block_size"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"mamba_cache_mode": "some"}, "mamba_cache_mode"),
    ],
)
def test_cache_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_page_sizes_and_memory_needs():
    full = FullAttentionSpec(16, 8, 128, "bfloat16")
    assert full.page_size_bytes == 2 * 16 * 8 * 128 * 2
    assert full.max_memory_usage_bytes(100) == 7 * full.page_size_bytes
    swa = SlidingWindowSpec(16, 8, 128, "bfloat16", sliding_window=32)
    # window - 1 + step tokens, +1 block for the straddle
    assert swa.max_memory_usage_bytes(4096, max_num_batched_tokens=64) == (6 + 1) * swa.page_size_bytes
    assert swa.max_memory_usage_bytes(40) == (3 + 1) * swa.page_size_bytes
    m = MambaSpec(((4, 64), (8, 16, 16)), ("float32", "bfloat16"), 64, "align")
    assert m.state_offsets() == [(0, 1024), (1024, 4096)]
    assert m.page_size_bytes == 5120
    assert m.max_memory_usage_bytes(10_000) == 2 * 5120
    assert MambaSpec(m.shapes, m.dtypes, 64, "none").max_memory_usage_bytes(10_000) == 5120
    assert MambaSpec(m.shapes, m.dtypes, 64, "all").max_memory_usage_bytes(1000) == 16 * 5120


def test_spec_validation():
    with pytest.raises(ValueError, match="dtype"):
        FullAttentionSpec(16, 1, 8, "int3")
    with pytest.raises(ValueError, match="one dtype per state"):
        MambaSpec(((4,),), ("float32", "float32"), 16)
    with pytest.raises(ValueError, match="widest dtype"):
        MambaSpec(((3,), (4,)), ("bfloat16", "float32"), 16)
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(16, 1, 8, "float16", sliding_window=0)


def test_uniform_model_one_group_one_buffer_per_layer():
    specs = {f"l{i}": FullAttentionSpec(16, 2, 64, "float16") for i in range(3)}
    cfg = get_kv_cache_config(specs, available_memory_bytes=10 * 8192 * 3, num_blocks=None, max_model_len=64)
    assert len(cfg.kv_cache_groups) == 1 and cfg.kv_cache_groups[0].layer_names == ["l0", "l1", "l2"]
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [["l0"], ["l1"], ["l2"]]
    assert cfg.num_blocks == 10 and all(t.size_bytes == 10 * 8192 for t in cfg.kv_cache_tensors)
    assert cfg.hash_block_size == 16 and cfg.scheduler_alignment == 1 and cfg.kernel_block_sizes == [16]


def test_hybrid_unifies_page_sizes_and_shares_buffers():
    specs = {"a0": FullAttentionSpec(16, 1, 16, "float16")}  # 64 bytes per token, page 1024
    specs |= {f"m{i}": MambaSpec(((10, 100),), ("float32",), 16) for i in range(3)}  # 4000 bytes
    specs["a1"] = FullAttentionSpec(16, 1, 16, "float16")
    cfg = get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=20, max_model_len=128)
    attn = cfg.kv_cache_groups[0].kv_cache_spec
    # raised to a multiple of 16 tokens until one page holds a state: 64 tokens * 64 B = 4096
    assert attn.block_size == 64 and attn.page_size_bytes == 4096
    mamba_groups = [g for g in cfg.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    assert all(g.kv_cache_spec.page_size_bytes == 4096 for g in mamba_groups)
    assert all(g.kv_cache_spec.block_size == 64 for g in mamba_groups)
    assert sum(len(g.layer_names) for g in cfg.kv_cache_groups) == 5
    assert max(len(g.layer_names) for g in cfg.kv_cache_groups) == 2  # group size = min layer count
    assert len(cfg.kv_cache_tensors) == 2
    for t in cfg.kv_cache_tensors:
        owners = [
            next(i for i, g in enumerate(cfg.kv_cache_groups) if n in g.layer_names) for n in t.shared_by
        ]
        assert len(owners) == len(set(owners)), "a buffer shared by two layers of one group"
        assert t.size_bytes == 20 * 4096
    assert cfg.hash_block_size == 64 and cfg.scheduler_alignment == 64


def test_pool_too_small_names_the_numbers():
    specs = {"l0": FullAttentionSpec(16, 1, 16, "float16")}
    with pytest.raises(ValueError, match=r"needs 8 blocks plus the null block"):
        get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=8, max_model_len=128)
    with pytest.raises(ValueError, match="8192 bytes of KV-cache memory give 8 blocks"):
        get_kv_cache_config(specs, available_memory_bytes=8192, num_blocks=None, max_model_len=128)
    with pytest.raises(ValueError, match="available_memory_bytes or num_blocks"):
        get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=None, max_model_len=128)


def test_attention_with_different_pages_is_an_error():
    specs = {"a": FullAttentionSpec(16, 1, 16, "float16"), "b": FullAttentionSpec(16, 2, 16, "float16")}
    with pytest.raises(ValueError, match="different page sizes"):
        get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=100, max_model_len=64)


def test_three_block_sizes_stay_separate():
    groups = [
        KVCacheGroupSpec(["a"], FullAttentionSpec(32, 1, 8, "float16")),
        KVCacheGroupSpec(["s"], SlidingWindowSpec(16, 1, 8, "float16", sliding_window=8)),
        KVCacheGroupSpec(["m"], MambaSpec(((4,),), ("float32",), 48, "align")),
    ]
    cfg = KVCacheConfig(num_blocks=10, kv_cache_groups=groups)
    assert cfg.kernel_block_sizes == [32, 16, 48]
    assert cfg.hash_block_size == 16  # gcd
    assert cfg.scheduler_alignment == 48  # lcm of align-mode recurrent groups


def test_mla_page_is_one_latent_row_per_token():
    """DeepSeek V3's latent (512) plus rope key (64) in bf16: one 1152-byte row per token, where an
    ordinary spec of the same head size stores K and V (twice the bytes)."""
    mla = MLAAttentionSpec(16, 1, 512 + 64, "bfloat16")
    assert mla.bytes_per_token == 576 * 2 and mla.page_size_bytes == 16 * 576 * 2
    assert FullAttentionSpec(16, 1, 576, "bfloat16").page_size_bytes == 2 * mla.page_size_bytes
    assert mla.max_memory_usage_bytes(100) == 7 * mla.page_size_bytes
    assert mla != FullAttentionSpec(16, 1, 576, "bfloat16")  # never grouped with ordinary attention
    with pytest.raises(ValueError, match="one latent head"):
        MLAAttentionSpec(16, 2, 576, "bfloat16")


def test_mla_pool_sizing_and_grouping():
    specs = {f"l{i}": MLAAttentionSpec(16, 1, 40, "float32") for i in range(3)}  # 160 B/token, 2560 B page
    cfg = get_kv_cache_config(specs, available_memory_bytes=3 * 10 * 2560, num_blocks=None, max_model_len=64)
    assert cfg.num_blocks == 10 and cfg.page_size_bytes == 2560
    assert len(cfg.kv_cache_groups) == 1 and isinstance(
        cfg.kv_cache_groups[0].kv_cache_spec, MLAAttentionSpec
    )
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [["l0"], ["l1"], ["l2"]]


def test_mla_unifies_with_recurrent_pages_by_its_own_bytes_per_token():
    """Beside a recurrent state, the MLA block size is raised by ITS bytes per token (one row, not two)."""
    specs = {"a": MLAAttentionSpec(16, 1, 32, "float16"), "m": MambaSpec(((10, 100),), ("float32",), 16)}
    cfg = get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=20, max_model_len=128)
    mla = next(g.kv_cache_spec for g in cfg.kv_cache_groups if isinstance(g.kv_cache_spec, MLAAttentionSpec))
    # 64 bytes per token: 4000-byte state -> 64 tokens of 64 bytes (an ordinary spec: 32 tokens of 128)
    assert mla.block_size == 64 and mla.page_size_bytes == 4096
    assert all(g.kv_cache_spec.page_size_bytes == 4096 for g in cfg.kv_cache_groups)


def test_mla_beside_ordinary_attention_is_refused():
    specs = {"a": MLAAttentionSpec(16, 1, 32, "float16"), "b": FullAttentionSpec(16, 1, 32, "float16")}
    with pytest.raises(ValueError, match="different page sizes"):
        get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=100, max_model_len=64)
