"""DeepSeek V2 / V3 (multi-head latent attention, grouped-top-k MoE) against transformers on tiny random
float32 checkpoints (tests/fixtures/checkpoints.py's ``_MLA`` shape): logits position by position over the
paged pool under chunked prefill, mixed batches, prefix hits and decodes; the absorbed decode path equal
to the expanded one; the routers against transformers' own; the latent pages byte by byte; what the
config refuses; and greedy parity through `LLM` with chunked prefill, prefix hits, preemption and n > 1.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import LLM_SHAPE, hf_config, load_ours, save_tiny
from tests.fixtures.llm import DENSE, make_llm
from tests.fixtures.paged_runner import (
    PagedRunner,
    assert_bf16_close_to_float32,
    assert_close_logits,
    check_request,
    hf_logits,
    mixed_batch_with_prefix_hit,
)
from tokenos.config import CacheConfig
from tokenos.core.kv_cache.spec import MambaSpec, MLAAttentionSpec, get_kv_cache_config
from tokenos.layers.attention_metadata import build_attention_metadata
from tokenos.layers.mla import MLAAttention, flat_latent_view
from tokenos.layers.weights import WeightHolder
from tokenos.models.deepseek import DeepseekMoE, route_noaux_tc, route_softmax
from tokenos.worker.kv_cache import allocate_kv_caches

# A yarn scaling whose attention factor (mscale / mscale_all_dim) and softmax mscale are both away from 1.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
CASES = {
    "v2_q_proj_group_limited": ("deepseek_v2", {}),
    "v2_q_lora_greedy_yarn_bias": (
        "deepseek_v2",
        {"q_lora_rank": 24, "topk_method": "greedy", "rope_parameters": YARN, "attention_bias": True},
    ),
    "v3_q_lora_noaux_tc": ("deepseek_v3", {}),
    # A large rms_norm_eps: the q_a / kv_a norms must keep transformers' 1e-6 regardless.
    "v3_yarn_mscale_large_eps": ("deepseek_v3", {"rope_parameters": YARN, "rms_norm_eps": 0.5}),
    "v3_q_proj_not_interleaved_unnormed": (
        "deepseek_v3",
        {"q_lora_rank": None, "rope_interleave": False, "norm_topk_prob": False, "n_shared_experts": 1},
    ),
}
PROMPT = [(i * 37 + 11) % 120 + 3 for i in range(45)]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(our model, transformers model) of each case's tiny checkpoint."""
    family, overrides = CASES[request.param]
    folder = str(tmp_path_factory.mktemp(request.param))
    ref = save_tiny(family, folder, **overrides)
    model, _ = load_ours(folder)
    return model, ref


def _mla_layers(model) -> list[MLAAttention]:
    return [m for m in model.modules() if isinstance(m, MLAAttention)]


def test_chunked_prefill_then_decode_matches(case):
    model, ref = case
    for block_size in (16, 32):
        runner = PagedRunner(model, block_size=block_size, seed=block_size)
        start = 0
        for size in (7, 13, 1, 9):  # odd chunks (a cached prefix from the second on), one a single token
            runner.step([(0, PROMPT[start : start + size])])
            start += size
        for token in PROMPT[start:]:
            runner.step([(0, [token])])
        assert_close_logits(runner.request_logits(0), hf_logits(ref, PROMPT))


def test_mixed_batch_prefix_hit_and_greedy_decodes(case):
    """Request 1 adopts request 0's first 32 tokens and computes its own tail beside request 0's decodes
    and request 2's prefill chunks; then greedy decodes of all three, fed back."""
    model, ref = case
    mixed_batch_with_prefix_hit(model, ref, PROMPT, decode_steps=4)


def test_absorbed_decode_equals_expanded(case):
    """The same decodes (several requests of different lengths in one step) with W_UK / W_UV absorbed and
    with the latents expanded through kv_b_proj: equal to float32 rounding."""
    model, _ = case
    runs = []
    for absorb in (True, False):
        for layer in _mla_layers(model):
            layer.absorb = absorb
        runner = PagedRunner(model, block_size=16, seed=2)
        runner.step([(0, PROMPT[:30]), (1, PROMPT[4:9]), (2, PROMPT[:18])])
        for t in range(5):
            runner.step([(0, [PROMPT[30 + t]]), (1, [PROMPT[9 + t]]), (2, [PROMPT[18 + t]])])
        runs.append(torch.cat([runner.request_logits(r)[-5:] for r in (0, 1, 2)]))
    for layer in _mla_layers(model):
        layer.absorb = True
    assert_close_logits(runs[0], runs[1], rel=1e-5)


def test_kv_cache_spec_is_one_latent_row(case):
    model, _ = case
    specs = model.get_kv_cache_spec(CacheConfig(block_size=16))
    assert list(specs) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    for spec in specs.values():
        assert type(spec) is MLAAttentionSpec and spec.num_kv_heads == 1
        assert spec.head_size == 32 + 8 and spec.page_size_bytes == 16 * 40 * 4


# ---------------------------------------------------------------- the layer alone


def _layer(heads: int = 3, nope: int = 5, rope: int = 4, v: int = 6, rank: int = 7) -> MLAAttention:
    kv_b = WeightHolder((heads * (nope + v), rank), None, torch.float32)
    kv_b.weight.data.normal_()
    return MLAAttention(heads, nope, rope, v, rank, 0.3, kv_b)


def test_absorbed_equals_expanded_on_random_latents():
    torch.manual_seed(0)
    layer = _layer()
    q = torch.randn(4, 1, 3, 9)
    kv = torch.randn(4, 11, 11)
    mask = (torch.arange(11) < torch.tensor([11, 3, 7, 1])[:, None])[:, None, None, :]
    torch.testing.assert_close(
        layer._absorbed(q, kv, mask), layer._expanded(q, kv, mask), rtol=1e-5, atol=1e-5
    )


def _fill(buf: torch.Tensor, salt: int) -> None:
    """A distinct byte per page; byte values 1..60 are small finite float32 numbers."""
    for b in range(buf.shape[0]):
        buf[b].fill_(1 + (b * 7 + salt) % 60)


@pytest.mark.parametrize("hybrid", [False, True], ids=["own-pool", "beside-recurrent-state"])
def test_pages_hold_latent_then_rope_key_and_nothing_else_moves(hybrid):
    """Byte pattern over the pool: one step writes exactly the scheduled tokens' rows (latent, then rope
    key, at row ``slot % block_size`` of block ``slot // block_size``), inside the request's pages only,
    also in a buffer shared with a recurrent layer (pages unified: the MLA block size raised to 16)."""
    layer = _layer()
    specs = {"mla": layer.get_kv_cache_spec(CacheConfig(block_size=4), "float32")}
    if hybrid:
        specs["m"] = MambaSpec(((3, 50),), ("float32",), 4)  # 600 bytes: MLA pages of 16 x 44 = 704
    config = get_kv_cache_config(specs, available_memory_bytes=None, num_blocks=12, max_model_len=32)
    caches = allocate_kv_caches(config, list(specs))
    cache = caches[0]
    block_size = cache.shape[1]
    page_bytes = config.page_size_bytes
    raw = (cache._base if cache._base is not None else cache).view(torch.uint8).view(12, -1)
    assert raw.shape[1] == page_bytes == block_size * 44 and block_size == (16 if hybrid else 4)
    assert [t.shared_by for t in config.kv_cache_tensors] == ([["mla", "m"]] if hybrid else [["mla"]])
    _fill(raw, salt=3)
    before = raw.clone()
    blocks = [7, 2, 9]  # request 0: 5 cached tokens, 6 new ones (they cross into its third block)
    blocks = blocks[: -(-11 // block_size)]
    meta = build_attention_metadata([blocks], [5], [6], block_size)
    torch.manual_seed(1)
    latent, k_pe, q = torch.randn(6, 7), torch.randn(6, 4), torch.randn(6, 3, 9)
    layer.attend(q, latent, k_pe, cache, meta)
    changed = set(torch.nonzero((raw != before).any(dim=1)).flatten().tolist())
    assert changed <= set(blocks) and 0 not in changed
    flat, rows_per_block = flat_latent_view(cache)
    for t, pos in enumerate(range(5, 11)):
        row = blocks[pos // block_size] * rows_per_block + pos % block_size
        torch.testing.assert_close(flat[row], torch.cat((latent[t], k_pe[t])), rtol=0, atol=0)
    # Bytes of the request's pages outside the written rows (earlier tokens, padding) kept their pattern.
    row_bytes = 11 * 4
    for b in blocks:
        written = [p % block_size for p in range(5, 11) if blocks[p // block_size] == b]
        keep = torch.ones(page_bytes, dtype=torch.bool)
        for r in written:
            keep[r * row_bytes : (r + 1) * row_bytes] = False
        assert torch.equal(raw[b][keep], before[b][keep])


def test_strided_pages_address_rows_by_the_page_stride():
    """Pages farther apart than their rows (a view into a wider page): each token's row lands at
    ``block * rows_per_block + offset`` and the rest of the page is untouched."""
    layer = _layer()
    block_size, width, rows_per_block = 4, 11, 6
    base = torch.full((8 * rows_per_block * width,), 7.0)
    cache = base.as_strided((8, block_size, 1, width), (rows_per_block * width, width, width, 1))
    flat, rpb = flat_latent_view(cache)
    assert rpb == rows_per_block
    meta = build_attention_metadata([[3, 5]], [2], [5], block_size)
    latent, k_pe = torch.randn(5, 7), torch.randn(5, 4)
    layer.attend(torch.randn(5, 3, 9), latent, k_pe, cache, meta)
    rows = base.view(8 * rows_per_block, width)
    written = [3 * rows_per_block + 2, 3 * rows_per_block + 3, 5 * rows_per_block, 5 * rows_per_block + 1]
    written.append(5 * rows_per_block + 2)
    torch.testing.assert_close(rows[written], torch.cat((latent, k_pe), -1), rtol=0, atol=0)
    others = torch.ones(rows.shape[0], dtype=torch.bool)
    others[written] = False
    assert bool((rows[others] == 7.0).all())


def test_writes_stay_in_owned_pages(case):
    """Through the whole model: every page of the pool filled with a pattern, only the scheduled requests'
    pages change, never the null block or an idle request's pages."""
    model, ref = case
    runner = PagedRunner(model, block_size=16, seed=5)
    buffers = runner.buffers()
    for buf in buffers:
        _fill(buf, salt=0)
    runner.step([("idle", PROMPT[:23])])
    a, b = PROMPT[3:43], PROMPT[10:40]
    for work in ([("a", a[:21]), ("b", b[:17])], [("b", b[17:]), ("a", a[21:])], [("a", [5]), ("b", [6])]):
        before = [buf.clone() for buf in buffers]
        runner.step(work)
        changed = set()
        for x, y in zip(before, buffers, strict=True):
            changed |= set(torch.nonzero((x != y).any(dim=1)).flatten().tolist())
        assert 0 not in changed and changed <= runner.owned(["a", "b"])
        assert not changed & runner.owned(["idle"])
    for req in ("a", "b", "idle"):
        check_request(runner, ref, req)


def test_bfloat16_close_to_float32(tmp_path):
    folder = str(tmp_path / "v3")
    save_tiny("deepseek_v3", folder)
    assert_bf16_close_to_float32(folder, PROMPT)


# ---------------------------------------------------------------- routing and the MoE block


def _sorted(weights: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = chosen.argsort(dim=-1)
    return weights.gather(1, order), chosen.gather(1, order)


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("deepseek_v2", {"topk_method": "group_limited_greedy"}),
        ("deepseek_v2", {"topk_method": "greedy"}),
        ("deepseek_v3", {}),
        ("deepseek_v3", {"norm_topk_prob": False, "n_group": 2, "topk_group": 1}),
    ],
)
def test_router_matches_transformers(family, overrides):
    import transformers

    config = hf_config(family, **overrides)
    module = transformers.models.deepseek_v3.modeling_deepseek_v3 if family == "deepseek_v3" else None
    if module is None:
        module = transformers.models.deepseek_v2.modeling_deepseek_v2
        router = module.DeepseekV2TopkRouter(config)
    else:
        router = module.DeepseekV3TopkRouter(config)
        router.e_score_correction_bias.normal_(0, 0.5)
    torch.manual_seed(4)
    router.weight.data.normal_()
    x = torch.randn(50, config.hidden_size)
    with torch.no_grad():
        logits, want_w, want_e = router(x)
    if family == "deepseek_v3":
        got = route_noaux_tc(
            logits,
            router.e_score_correction_bias,
            config.num_experts_per_tok,
            config.n_group,
            config.topk_group,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        )
    else:
        got = route_softmax(
            logits,
            config.num_experts_per_tok,
            config.topk_method,
            config.n_group,
            config.topk_group,
            config.routed_scaling_factor,
        )
    got_w, got_e = _sorted(*got)
    want_w, want_e = _sorted(want_w, want_e)
    assert torch.equal(got_e, want_e)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)


def test_group_limit_and_bias_change_the_choice():
    """The group limit and V3's correction bias both decide experts here (so the tests above can fail)."""
    torch.manual_seed(0)
    logits = torch.randn(200, 8)
    _, limited = route_softmax(logits, 2, "group_limited_greedy", 4, 1, 1.0)
    _, greedy = route_softmax(logits, 2, "greedy", 4, 1, 1.0)
    assert not torch.equal(limited.sort(-1).values, greedy.sort(-1).values)
    _, unbiased = route_noaux_tc(logits, torch.zeros(8), 2, 4, 2, True, 1.0)
    _, biased = route_noaux_tc(logits, torch.linspace(-1, 1, 8), 2, 4, 2, True, 1.0)
    assert not torch.equal(unbiased.sort(-1).values, biased.sort(-1).values)


def test_moe_block_loads_and_matches_transformers(tmp_path):
    folder = str(tmp_path / "v3")
    ref = save_tiny("deepseek_v3", folder)
    model, _ = load_ours(folder)
    ours = model.stack.layers[1].mlp
    assert isinstance(ours, DeepseekMoE) and not isinstance(model.stack.layers[0].mlp, DeepseekMoE)
    x = torch.randn(30, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref.model.layers[1].mlp(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the checkpoint and the config


def test_mtp_layers_skipped_and_missing_latent_projection_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path / "v3")
    save_tiny("deepseek_v3", folder)
    path = f"{folder}/model.safetensors"
    tensors = load_file(path)
    # A released V3 checkpoint carries its multi-token-prediction layer as model.layers.<num_layers>.
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, path, metadata={"format": "pt"})
    load_ours(folder)
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_ours(folder)


@pytest.mark.parametrize(
    "family,overrides,match",
    [
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
        ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method 'greedy'"),
        ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
        ("deepseek_v3", {"n_group": 8, "topk_group": 2}, "expert"),
        ("deepseek_v2", {"num_key_value_heads": 2}, "num_key_value_heads"),
        ("deepseek_v2", {"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_configs_we_cannot_serve_exactly_are_refused(tmp_path, family, overrides, match):
    import json

    folder = str(tmp_path / family)
    save_tiny(family, folder, perturbed=False)
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    cfg.update(overrides)
    with open(f"{folder}/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=match):
        load_ours(folder)


def test_8bit_kv_pages_refused(tmp_path):
    folder = str(tmp_path / "v2")
    save_tiny("deepseek_v2", folder, perturbed=False)
    model, _ = load_ours(folder)
    with pytest.raises(ValueError, match="latent attention"):
        model.get_kv_cache_spec(CacheConfig(block_size=16, cache_dtype="fp8"))


# ---------------------------------------------------------------- through `LLM`


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_llm_greedy_parity_chunked_prefix_hits_preemption_and_n(tmp_path, family):
    folder = str(tmp_path / family)
    ref = save_tiny(family, folder, **LLM_SHAPE)
    # Chunked prefill (8-token budget) with prompts sharing 32 tokens: prefix hits inside one engine.
    shared = DENSE.prompts(1, 32, 32, seed=3)[0]
    prompts = [shared + tail for tail in DENSE.prompts(3, 2, 12, seed=4)]
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=8)
    first = DENSE.run(llm, prompts[:1])
    DENSE.check(first, prompts[:1], ref)
    rest = DENSE.run(llm, prompts[1:], n=2)
    DENSE.check(rest, prompts[1:], ref)
    assert all(o.num_cached_tokens >= 32 for o in rest) and all(len(o.outputs) == 2 for o in rest)
    del llm
    # 16 usable blocks of 16 tokens cannot hold 8 requests of ~55 tokens: the scheduler must preempt.
    prompts = DENSE.prompts(8, 30, 60, seed=11)
    llm = make_llm(folder, block_size=16, num_kv_blocks=17, max_model_len=128, enable_prefix_caching=False)
    outputs = DENSE.run(llm, prompts)
    assert llm.get_metrics()["num_preemptions"] > 0
    DENSE.check(outputs, prompts, ref)


def test_llm_greedy_parity_with_ngram_drafts(tmp_path):
    """Drafts verified in one forward run several query tokens after a cached context: the expanded path
    on a cached prefix at every decode step, rejected drafts' rows overwritten later."""
    folder = str(tmp_path / "v3")
    ref = save_tiny("deepseek_v3", folder, **LLM_SHAPE)
    prompts = [p * 3 for p in DENSE.prompts(3, 4, 10, seed=3)] + DENSE.prompts(1, 5, 30, seed=4)
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "disable_by_batch_size": 64,
    }
    llm = make_llm(folder, speculative_config=ngram, max_num_batched_tokens=16)
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
    metrics = llm.get_metrics()["spec_decoding"]
    assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0, metrics
