"""Hybrid and recurrent models (Mamba2, Bamba, Qwen3-Next, GraniteMoeHybrid, Falcon-H1, NemotronH) vs
transformers, over a real paged pool.

`tests.fixtures.paged_runner.PagedRunner` plays the worker by hand, literally following the
SchedulerOutput contract of ``tokenos/core/sched/output.py``, over the pool the engine builds (pages padded
and views strided exactly as in serving). Every test compares logits (float32, tight tolerance) with
transformers' pure-torch forward on the same tokens.
"""

from __future__ import annotations

import torch

from tests.fixtures.paged_runner import PagedRunner, check_request, decode_greedy, random_tokens, run_chunks
from tokenos.config import CacheConfig
from tokenos.core.kv_cache.spec import FullAttentionSpec, MambaSpec, get_kv_cache_config


def test_kv_cache_spec_and_unified_block_size(family):
    name, model, _ = family
    specs = model.get_kv_cache_spec(CacheConfig(block_size=16))
    assert list(specs) == [name for name, _ in model.cache_layers()]
    kinds = {type(s) for s in specs.values()}
    assert MambaSpec in kinds and (FullAttentionSpec in kinds) == (name != "mamba2")
    config = get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=32, max_model_len=256)
    sizes = {g.kv_cache_spec.block_size for g in config.kv_cache_groups}
    # One block size for every group after unification: recurrent boundaries line up with attention's.
    assert len(sizes) == 1
    assert {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups} == {config.page_size_bytes}
    if name in ("bamba", "granitemoehybrid", "granitemoehybrid_dense", "falcon_h1", "nemotron_h"):
        assert sizes == {32}  # one Mamba state (3200 B) needs two 16-token attention pages of 1 KiB
    else:
        assert sizes == {16}


def test_chunked_prefill_two_requests_then_decode(family):
    """Odd chunks crossing block boundaries, two requests per step, then greedy decode for both."""
    _, model, ref = family
    runner = PagedRunner(model, seed=1)
    run_chunks(
        runner,
        {
            "a": (random_tokens(1, 75), [7, 13, 1, 20, 11, 23]),
            "b": (random_tokens(2, 41), [30, 1, 1, 9]),
        },
    )
    decode_greedy(runner, ["a", "b"], 5)
    for req in ("a", "b"):
        check_request(runner, ref, req)


def test_resume_from_checkpoint_page(family):
    """A request adopts another's block-boundary checkpoint (copied into its own running page) and
    computes only its suffix, in the same steps as the producer keeps going."""
    _, model, ref = family
    runner = PagedRunner(model, seed=2)
    bs = runner.groups[0].kv_cache_spec.block_size
    shared = random_tokens(3, 2 * bs)
    run_chunks(runner, {"a": (shared + random_tokens(4, 9), [bs - 3, bs + 3, 9])})  # step 2 ends on 2 * bs
    runner.adopt("c", "a", 2 * bs)
    suffix = random_tokens(5, 19)
    runner.step([("a", [runner.greedy("a")]), ("c", suffix[:6])])
    runner.step([("c", suffix[6:]), ("a", [runner.greedy("a")])])
    decode_greedy(runner, ["c", "a"], 3)
    check_request(runner, ref, "a")
    check_request(runner, ref, "c", first=2 * bs)
    # The adopted checkpoint is still intact for the next consumer: resume a third request from it.
    runner.adopt("d", "a", 2 * bs)
    runner.step([("d", suffix[:1]), ("c", [runner.greedy("c")])])
    check_request(runner, ref, "d", first=2 * bs)


def test_none_mode_single_page(family):
    """ "none" mode: one recurrent page for the whole request, never copied."""
    _, model, ref = family
    runner = PagedRunner(model, mode="none", seed=4)
    run_chunks(runner, {"a": (random_tokens(6, 37), [5, 17, 15]), "b": (random_tokens(7, 20), [20])})
    decode_greedy(runner, ["a", "b"], 2)
    for g in runner.group_layers:
        assert len(runner.blocks["a"][g]) == 1
    for req in ("a", "b"):
        check_request(runner, ref, req)


def test_all_mode_checkpoints_every_block(family):
    """ "all" mode: one prefill chunk crossing several boundaries (and a decode landing on one) leaves a
    checkpoint in every block's page; a request resumed from each of them matches transformers."""
    _, model, ref = family
    runner = PagedRunner(model, mode="all", num_blocks=64, seed=6)
    bs = runner.groups[0].kv_cache_spec.block_size
    toks = random_tokens(11, 3 * bs)
    run_chunks(runner, {"a": (toks, [5, 2 * bs + 4, bs - 10, 1])})  # boundaries bs and 2 * bs inside a chunk
    assert runner.computed["a"] == 3 * bs  # the last one-token step ends on 3 * bs
    check_request(runner, ref, "a")
    for j in (1, 2, 3):
        runner.adopt(f"r{j}", "a", j * bs)
    suffix = random_tokens(12, 7)
    runner.step([(f"r{j}", suffix[: 2 + j]) for j in (1, 2, 3)])
    for j in (1, 2, 3):
        check_request(runner, ref, f"r{j}", first=j * bs)


def _fill(buffers: list[torch.Tensor], pages, salt: int) -> None:
    """A distinct byte per (buffer, page); byte values 1..60 are small finite float32/bfloat16 numbers."""
    for i, buf in enumerate(buffers):
        for b in pages:
            buf[b].fill_(1 + (b * 7 + i * 13 + salt) % 60)


def _changed_pages(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    out = set()
    for x, y in zip(before, after, strict=True):
        out |= set(torch.nonzero((x != y).any(dim=1)).flatten().tolist())
    return out


def test_writes_stay_in_owned_pages(family):
    """Fill every page with a pattern, run steps, and check only the scheduled requests' pages change
    (through any layer's view: attention K/V, conv and SSM states, state copies)."""
    _, model, ref = family
    runner = PagedRunner(model, seed=5)
    num_blocks = runner.config.num_blocks
    buffers = runner.buffers()
    _fill(buffers, range(num_blocks), salt=0)  # new requests must not care what their pages held

    idle = random_tokens(8, 23)
    runner.step([("idle", idle)])  # a request that stays in the pool but is not scheduled again
    a, b = random_tokens(9, 50), random_tokens(10, 30)
    steps = [[("a", a[:21]), ("b", b[:17])], [("b", b[17:]), ("a", a[21:40])], [("a", a[40:])]]
    for work in steps:
        reqs = [r for r, _ in work]
        free = set(range(num_blocks)) - runner.owned(["a", "b", "idle"])
        _fill(buffers, sorted(free), salt=len(runner.free))
        before = [buf.clone() for buf in buffers]
        runner.step(work)
        changed = _changed_pages(before, buffers)
        # Pages allocated this step are owned now; pages released after it were owned during it.
        allowed = (
            runner.owned(reqs)
            | (free - set(runner.free) - runner.owned(["idle"]))
            | (set(runner.free) - free)
        )
        assert 0 not in changed, "a write landed in the null block"
        assert changed <= allowed, (
            f"pages {sorted(changed - allowed)} changed but no scheduled request owns them"
        )
        assert not changed & runner.owned(["idle"])
    for req in ("a", "b", "idle"):
        check_request(runner, ref, req)
