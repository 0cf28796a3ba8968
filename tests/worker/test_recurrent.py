"""tokenos/worker/recurrent.py: running columns, per-step RecurrentBatch, state copies over a real pool, and
the speculative rollback API on a real Mamba2 mixer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fixtures.checkpoints import hf_config
from tokenos.core.kv_cache.spec import FullAttentionSpec, MambaSpec, get_kv_cache_config
from tokenos.worker.kv_cache import allocate_kv_caches
from tokenos.worker.recurrent import (
    apply_state_copies,
    boundary_pages,
    build_recurrent_batch,
    group_layer_indices,
    readvance_batch,
    restore_checkpoint,
    rollback,
    running_block_ids,
    running_column,
)


def test_running_column() -> None:
    assert running_column(0, 1, 16) == 0
    assert running_column(0, 16, 16) == 0  # ends exactly on the boundary: still column 0
    assert running_column(0, 17, 16) == 1
    assert running_column(16, 1, 16) == 1
    assert running_column(40, 30, 16, "none") == 0


def test_running_block_ids_skips_unscheduled() -> None:
    lists = [[0, 7, 9], [5], [3, 4]]
    got = running_block_ids(lists, np.array([20, 0, 9]), np.array([13, 3, 0]), 16)
    assert got.tolist() == [9, 5, 0]


def test_build_recurrent_batch() -> None:
    batch = build_recurrent_batch(
        np.array([0, 5, 6, 6]), np.array([0, 12, 3]), np.array([5, 1, 0]), np.array([4, 8, 0])
    )
    assert batch.lengths == [5, 1, 0]
    assert batch.has_initial_state.tolist() == [False, True, True]
    assert batch.state_rows.tolist() == [4, 8, 0]
    assert batch.num_computed_tokens == [0, 12, 3]
    assert batch.prefill_reqs == [0] and batch.decode_reqs == [1]


def test_boundary_pages_and_checkpointing_batch() -> None:
    """ "all" mode: boundaries b with n < b <= n + k, by request then position, page of column b // B - 1."""
    lists = [[11, 12, 13, 14], [21, 22], [31]]
    n, k = np.array([5, 16, 3]), np.array([44, 1, 2])
    pages = boundary_pages(lists, n, k, 16)
    assert pages.tolist() == [11, 12, 13]  # 16, 32, 48 for the first; 17 and 5 reach none
    batch = build_recurrent_batch(np.array([0, 44, 45, 47]), n, k, np.array([14, 22, 31]), pages, 16)
    assert [(r, t) for r, t in batch.checkpoint_positions(16)] == [(0, 11), (0, 27), (0, 43)]
    assert batch.checkpoint_pages.tolist() == [11, 12, 13]
    with pytest.raises(ValueError, match="checkpoint pages"):
        build_recurrent_batch(np.array([0, 44, 45, 47]), n, k, np.array([14, 22, 31]), pages[:2], 16)


def test_build_recurrent_batch_rejects_null_running_page_and_bad_lengths() -> None:
    with pytest.raises(ValueError, match="null"):
        build_recurrent_batch(np.array([0, 2]), np.array([0]), np.array([2]), np.array([0]))
    with pytest.raises(ValueError, match="query_start_loc"):
        build_recurrent_batch(np.array([0, 3]), np.array([0]), np.array([2]), np.array([5]))


@pytest.fixture
def pool():
    """attention + two recurrent groups of one layer each, sharing one padded pool (strided state views)."""
    mamba = MambaSpec(((3, 8), (2, 4, 4)), ("float32", "float32"), block_size=16)
    specs = {"attn": FullAttentionSpec(16, 1, 8, "float32"), "m0": mamba, "m1": mamba}
    config = get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=12, max_model_len=64)
    caches = allocate_kv_caches(config, list(specs))
    for cache in caches:
        for t in cache if isinstance(cache, list) else [cache]:
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + 1000 * t.shape[-1])
    return config, list(specs), caches


def test_group_layer_indices(pool) -> None:
    config, order, _ = pool
    groups = group_layer_indices(config, order)
    names = {g: config.kv_cache_groups[g].layer_names for g in groups}
    assert sorted(order[i] for ids in groups.values() for i in ids) == ["m0", "m1"]
    assert all(order[i] in names[g] for g, ids in groups.items() for i in ids)


def test_apply_state_copies_copies_whole_pages_and_nothing_else(pool) -> None:
    """Groups share the pool's buffer (one layer of each group per buffer), so a page belongs to one group
    at a time: the copy must rewrite exactly the destination pages, with the source's states."""
    config, order, caches = pool
    groups = group_layer_indices(config, order)
    g0, g1 = sorted(groups)
    attn = caches[order.index("attn")]
    raw = attn.view(torch.uint8).view(config.num_blocks, -1)  # the whole page, every view's bytes
    raw_before = raw.clone()
    before = {i: [t.clone() for t in caches[i]] for ids in groups.values() for i in ids}
    blocks = {("a", g0): [3, 0, 5], ("a", g1): [4, 0, 6], ("b", g0): [7, 8]}
    copies = {"a": {g0: (0, 2), g1: (0, 2)}, "b": {g0: (1, 0)}}
    assert apply_state_copies(copies, lambda r, g: blocks[(r, g)], groups, caches) == 3
    changed = torch.nonzero((raw != raw_before).any(dim=1)).flatten().tolist()
    assert changed == [5, 6, 7]
    for g, pairs in {g0: {5: 3, 7: 8}, g1: {6: 4}}.items():
        for i in groups[g]:
            for now, was in zip(caches[i], before[i], strict=True):
                for dst, src in pairs.items():
                    assert torch.equal(now[dst], was[src]), (order[i], dst)


def test_apply_state_copies_reads_sources_before_writing(pool) -> None:
    """A swap (page 1 -> 2 and 2 -> 1 in the same step) copies the pre-step contents."""
    config, order, caches = pool
    groups = group_layer_indices(config, order)
    g = min(groups)
    pools = caches[groups[g][0]]
    old = [p.clone() for p in pools]
    blocks = {"a": [1, 2], "b": [2, 1]}
    apply_state_copies({"a": {g: (0, 1)}, "b": {g: (0, 1)}}, lambda r, _: blocks[r], groups, caches)
    for now, was in zip(pools, old, strict=True):
        assert torch.equal(now[2], was[1]) and torch.equal(now[1], was[2])


def test_apply_state_copies_rejects_null_block(pool) -> None:
    config, order, caches = pool
    groups = group_layer_indices(config, order)
    g = min(groups)
    with pytest.raises(ValueError, match="null block"):
        apply_state_copies({"a": {g: (0, 1)}}, lambda r, _: [0, 4], groups, caches)


def test_rollback_restores_checkpoint_and_readvances_accepted_tokens():
    """Speculative decoding on a Mamba2 mixer over a paged state pool: advance 6 draft tokens from a
    checkpoint, accept 2, roll back; the state and outputs equal a straight run over the accepted tokens."""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

    from tokenos.layers.mamba2 import Mamba2Mixer

    torch.manual_seed(0)
    config = hf_config("mamba2")  # the tiny Mamba2 of the model tests (hidden size 16)
    hf = HFMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        hf.D.copy_(torch.randn_like(hf.D))
        hf.conv1d.bias.copy_(0.2 * torch.randn_like(hf.conv1d.bias))
    mixer = Mamba2Mixer(config)
    mixer.load_weights(hf.state_dict().items())
    shapes, _ = Mamba2Mixer.state_shapes(config)
    pools = [torch.zeros(6, *s) for s in shapes]  # pages 1..5; 0 is the null block
    layer_caches = [pools]
    x = torch.randn(20, 16)
    accepted, drafts = x[11:13], torch.randn(6, 16)

    def advance(inputs, batch):
        return mixer.advance(inputs, batch, *pools)

    with torch.no_grad():
        straight = advance(x[:13], readvance_batch(0, 13, 1))  # page 1: the reference
        advance(x[:11], readvance_batch(0, 11, 2))  # page 2: the checkpoint after 11 tokens
        restore_checkpoint(layer_caches, 2, 3)  # page 3: the running page, speculating
        advance(torch.cat([accepted[:1], drafts]), readvance_batch(11, 7, 3))
        out = rollback(layer_caches, 2, 3, 11, accepted, advance)
    assert torch.allclose(out, straight[11:13], atol=1e-5)
    for pool in pools:
        assert torch.allclose(pool[3], pool[1], atol=1e-5)
        assert not torch.equal(pool[2], pool[1])  # the checkpoint itself is untouched
