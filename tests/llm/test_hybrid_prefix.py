"""Hybrid prefix caching beyond vLLM, end to end through `LLM` against transformers greedy:
checkpoints every C tokens independent of the attention page (a shared system prompt hits), exact
end-of-request checkpoints (a three-turn chat resumes each turn from the whole previous one),
preemption resuming from the latest checkpoint, and the recurrent rollback API.

Hit rates are printed (run with -s): prefix_cache_hits / prefix_cache_queries, in tokens."""

from __future__ import annotations

import random

import torch

from tests.llm.test_hybrid_parity import check, hf_greedy, make_llm, prompts_of, run
from tests.models.test_hybrid_models import VOCAB

INTERVAL = 8  # tokens per recurrent checkpoint (the tiny models' attention pages are larger or equal)


def hit_rate(llm) -> tuple[int, int]:
    m = llm.get_metrics()
    return m["prefix_cache_hits"], m["prefix_cache_queries"]


def test_shared_system_prompt(hybrid):
    folder, ref = hybrid
    shared = prompts_of(1, 5 * INTERVAL + 3, 5 * INTERVAL + 3, seed=20)[0]
    prompts = [shared + tail for tail in prompts_of(4, 3, 12, seed=21)]
    rates = {}
    for name, kwargs in {
        "off": {},
        "on": dict(mamba_cache_mode="all", mamba_checkpoint_interval=INTERVAL),
    }.items():
        llm = make_llm(folder, **kwargs)
        outs = [run(llm, [p])[0] for p in prompts]  # one at a time: each sees the earlier ones
        check(outs, prompts, ref)
        rates[name] = hit_rate(llm)
        cached = [o.num_cached_tokens for o in outs]
        print(
            f"\n{name}: page {llm.engine.kv_cache_config.kernel_block_sizes}, cached {cached}, "
            f"hits {rates[name][0]}/{rates[name][1]} tokens"
        )
        if name == "on":
            assert cached[0] == 0
            assert all(c >= 5 * INTERVAL for c in cached[1:])
    assert rates["on"][0] >= 3 * 5 * INTERVAL > rates["off"][0]


def test_three_turn_chat(hybrid):
    folder, ref = hybrid
    llm = make_llm(folder)  # end checkpoints are on by default
    rng = random.Random(22)
    conversation: list[int] = []
    cached = []
    for turn in range(3):
        prompt = conversation + [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 15))]
        out = run(llm, [prompt])
        check(out, [prompt], ref)
        cached.append(out[0].num_cached_tokens)
        if turn:  # the whole previous turn, but its last sampled token (never fed back)
            assert cached[-1] == len(conversation) - 1
        conversation = prompt + list(out[0].outputs[0].token_ids)
    hits, queries = hit_rate(llm)
    print(f"\nchat: cached {cached}, hits {hits}/{queries} tokens")


def test_preemption_resumes_from_checkpoint(hybrid):
    """Distinct prompts (nothing shared), a pool for one request: every hit is a preempted request
    resuming from its latest surviving checkpoint instead of recomputing from zero."""
    folder, ref = hybrid
    kwargs = dict(mamba_checkpoint_interval=INTERVAL, max_model_len=64)
    probe = make_llm(folder, **kwargs)
    groups = probe.engine.kv_cache_config.kv_cache_groups
    del probe

    def pages(num_tokens: int) -> int:
        return sum(
            -(-g.kv_cache_spec.max_memory_usage_bytes(num_tokens) // g.kv_cache_spec.page_size_bytes)
            for g in groups
        )

    # Prompts 2 tokens short of an interval boundary and a pool for two of them plus a few pages:
    # they soon need new pages at once, so some are preempted and later resume. Whether a victim's
    # checkpoint pages survive until it is readmitted depends on the exact page sizes of the
    # family, so two pool sizes are tried: every run must keep parity, one must resume from a hit.
    length = 6 * INTERVAL - 2
    prompts = prompts_of(6, length, length, seed=23)
    seen = []
    for extra in (2, 4):
        llm = make_llm(folder, num_kv_blocks=2 * pages(length) + extra, max_num_batched_tokens=32, **kwargs)
        check(run(llm, prompts), prompts, ref)
        metrics = llm.get_metrics()
        seen.append((metrics["num_preemptions"], metrics["prefix_cache_hits"]))
        del llm
    print(f"\npreemption: (preemptions, hit tokens) per pool size: {seen}")
    assert any(preemptions > 0 and hits > 0 for preemptions, hits in seen)


def test_rollback_restores_checkpoint_and_readvances_accepted_tokens():
    """Speculative decoding on a Mamba2 mixer over a paged state pool: advance 6 draft tokens from a
    checkpoint, accept 2, roll back; the state and outputs equal a straight run over the accepted tokens."""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

    from tests.models.test_hybrid_models import _hf_config
    from tokenos.layers.mamba2 import Mamba2Mixer
    from tokenos.worker.recurrent import readvance_batch, restore_checkpoint, rollback

    torch.manual_seed(0)
    config = _hf_config("mamba2")  # the tiny Mamba2 of the model tests (hidden size 16)
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


def test_default_settings(hybrid):
    """By default: vLLM's page-sized checkpoints, plus end-of-request checkpoints (no memory cost);
    turning the latter off gives exactly vLLM's behaviour."""
    folder, _ = hybrid
    llm = make_llm(folder)
    cfg = llm.engine.kv_cache_config
    assert len(set(cfg.kernel_block_sizes)) == 1
    fine = llm.engine.scheduler.kv_cache_manager.fine
    assert fine is not None and fine.at_end
    del llm
    assert make_llm(folder, mamba_checkpoint_at_end=False).engine.scheduler.kv_cache_manager.fine is None
    assert hf_greedy  # the same reference helper as test_hybrid_parity
