"""Gated DeltaNet parity with transformers' pure-torch Qwen3NextGatedDeltaNet, and state invariants.

Our layer runs with chunk size 16 (transformers uses 64), so short sequences cross several chunks and the
parity tests also show the result does not depend on the chunking.
"""

import dataclasses

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from tests.layers.recurrent_harness import check_split_prefill_equals_one_pass, nan_states, run
from tokenos.layers.chunked_scan import chunk_layout
from tokenos.layers.gated_delta import GatedDeltaDims, GatedDeltaNet, chunk_gated_delta_rule, gated_delta_step
from tokenos.layers.recurrent_batch import RecurrentBatch

ATOL = 1e-4
HIDDEN = 32


@pytest.fixture(scope="module")
def config() -> Qwen3NextConfig:
    # 2 key heads serving 4 value heads (grouped), so the head-grouped projection layout matters.
    return Qwen3NextConfig(
        hidden_size=HIDDEN,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
    )


@pytest.fixture(scope="module")
def layers(config: Qwen3NextConfig) -> tuple[Qwen3NextGatedDeltaNet, GatedDeltaNet]:
    torch.manual_seed(0)
    hf = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        hf.norm.weight.copy_(1 + 0.2 * torch.randn_like(hf.norm.weight))
        hf.dt_bias.copy_(torch.randn_like(hf.dt_bias))
        hf.A_log.copy_(torch.empty_like(hf.A_log).uniform_(-2, 1))
    ours = GatedDeltaNet(dataclasses.replace(GatedDeltaDims.from_config(config), chunk_size=16))
    loaded = ours.load_weights(hf.state_dict().items())
    assert loaded == {name for name, _ in ours.named_parameters()}
    return hf, ours


def shapes(config: Qwen3NextConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    state_shapes, dtypes = GatedDeltaNet.state_shapes(config)
    assert dtypes == ("float32", "float32")
    return state_shapes


def fresh_states(config: Qwen3NextConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return nan_states(shapes(config), n)


def random_states(config: Qwen3NextConfig, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv_shape, rec_shape = shapes(config)
    return torch.randn(n, *conv_shape), 0.3 * torch.randn(n, *rec_shape)


def test_state_shapes(config: Qwen3NextConfig) -> None:
    assert shapes(config) == ((3, 2 * 16 + 32), (4, 8, 8))


def test_chunked_rule_equals_recurrence() -> None:
    """The kernel alone: chunked form over odd lengths == the token-by-token delta rule."""
    torch.manual_seed(1)
    lengths, h, dk, dv = [5, 37, 2], 3, 4, 6
    t = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk), dim=-1)
    v, g, beta = torch.randn(t, h, dv), -torch.rand(t, h), torch.rand(t, h)
    init = torch.randn(len(lengths), h, dk, dv)
    batch = RecurrentBatch(torch.tensor([0] + lengths).cumsum(0), torch.ones(3, dtype=torch.bool))
    layout = chunk_layout(batch, 8, align=False)
    out, boundary = chunk_gated_delta_rule(q, k, v, g, beta, layout, init)
    start = 0
    for r, n in enumerate(lengths):
        state = init[r : r + 1]
        for i in range(start, start + n):
            o, state = gated_delta_step(
                state, q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1]
            )
            torch.testing.assert_close(out[i], o[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(boundary[r, layout.chunks_per_req[r]], state[0], atol=ATOL, rtol=0)
        start += n


@torch.no_grad()
def test_full_prefill_matches_transformers(config, layers) -> None:
    hf, ours = layers
    torch.manual_seed(2)
    x = torch.randn(2, 45, HIDDEN)
    cache = DynamicCache(config=config)
    ref = hf(x, cache=cache)
    conv, rec = fresh_states(config, 2)
    outs = run(ours, [x[0], x[1]], conv, rec, [False, False])
    for b in range(2):
        torch.testing.assert_close(outs[b], ref[b], atol=ATOL, rtol=0)
    torch.testing.assert_close(conv, cache.get_conv_state(0)[..., 1:].transpose(1, 2), atol=ATOL, rtol=0)
    torch.testing.assert_close(rec, cache.get_recurrent_state(0), atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("pieces", [[1, 7, 13, 2, 17], [3, 1, 1, 30, 1], [16, 16, 17, 5]])
def test_split_prefill_equals_one_pass(config, layers, pieces) -> None:
    check_split_prefill_equals_one_pass(layers[1], shapes(config), HIDDEN, pieces, seed=3, atol=ATOL)


@torch.no_grad()
def test_prefill_then_decode_matches_transformers(config, layers) -> None:
    hf, ours = layers
    torch.manual_seed(4)
    prompt, steps = 21, 6
    x = torch.randn(1, prompt + steps, HIDDEN)
    full = hf(x)
    cache = DynamicCache(config=config)
    hf_steps = [hf(x[:, :prompt], cache=cache)[0]]
    conv, rec = fresh_states(config, 1)
    ours_out = [run(ours, [x[0, :prompt]], conv, rec, [False])[0]]
    for t in range(prompt, prompt + steps):
        ours_out.append(run(ours, [x[0, t : t + 1]], conv, rec, [True])[0])
        hf_steps.append(hf(x[:, t : t + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(ours_out), full[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(ours_out), torch.cat(hf_steps), atol=ATOL, rtol=0)
    torch.testing.assert_close(rec, cache.get_recurrent_state(0), atol=ATOL, rtol=0)


@torch.no_grad()
def test_mixed_batch_over_pool_equals_each_alone(config, layers) -> None:
    _, ours = layers
    torch.manual_seed(5)
    lengths = [1, 23, 0, 1, 9, 2, 40]
    has_init = [True, True, True, False, False, True, True]
    seqs = [torch.randn(n, HIDDEN) for n in lengths]
    pool_conv, pool_rec = random_states(config, 10)
    slots = [7, 2, 5, 0, 9, 4, 1]
    expect = []
    for i, s in enumerate(seqs):
        conv, rec = pool_conv[slots[i] : slots[i] + 1].clone(), pool_rec[slots[i] : slots[i] + 1].clone()
        out = run(ours, [s], conv, rec, [has_init[i]])[0] if len(s) else s
        expect.append((out, conv[0], rec[0]))
    untouched = (pool_conv[[3, 6, 8]].clone(), pool_rec[[3, 6, 8]].clone())
    outs = run(ours, seqs, pool_conv, pool_rec, has_init, state_indices=slots)
    for i, (out, conv, rec) in enumerate(expect):
        torch.testing.assert_close(outs[i], out, atol=ATOL, rtol=0)
        torch.testing.assert_close(pool_conv[slots[i]], conv, atol=ATOL, rtol=0)
        torch.testing.assert_close(pool_rec[slots[i]], rec, atol=ATOL, rtol=0)
    assert torch.equal(pool_conv[[3, 6, 8]], untouched[0]) and torch.equal(pool_rec[[3, 6, 8]], untouched[1])


@torch.no_grad()
@pytest.mark.parametrize("every", [16, 24, 8])
def test_checkpoints_equal_split_states_and_resume(config, layers, every) -> None:
    _, ours = layers
    torch.manual_seed(6)
    starts, lengths = [5, 16, 23], [50, 17, 1]
    seqs = [torch.randn(n, HIDDEN) for n in lengths]
    conv0, rec0 = random_states(config, 3)
    conv, rec = conv0.clone(), rec0.clone()
    qsl = torch.tensor([0] + lengths).cumsum(0)
    batch = RecurrentBatch(qsl, torch.ones(3, dtype=torch.bool), num_computed_tokens=torch.tensor(starts))
    out, ckpt = ours.advance_with_checkpoints(torch.cat(seqs), batch, conv, rec, every)
    expect = [
        (r, p) for r in range(3) for p in range(starts[r] + 1, starts[r] + lengths[r] + 1) if p % every == 0
    ]
    assert [(int(r), int(p)) for r, p in zip(ckpt.req_indices, ckpt.num_tokens, strict=True)] == expect
    conv2, rec2 = conv0.clone(), rec0.clone()
    torch.testing.assert_close(out, ours.advance(torch.cat(seqs), batch, conv2, rec2), atol=ATOL, rtol=0)
    torch.testing.assert_close(rec, rec2, atol=ATOL, rtol=0)
    torch.testing.assert_close(conv, conv2, atol=ATOL, rtol=0)
    outs = list(out.split(lengths))
    for i, (r, pos) in enumerate(expect):
        n = pos - starts[r]
        c, s = conv0[r : r + 1].clone(), rec0[r : r + 1].clone()
        run(ours, [seqs[r][:n]], c, s, [True])
        torch.testing.assert_close(ckpt.conv_states[i], c[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(ckpt.recurrent_states[i], s[0], atol=ATOL, rtol=0)
        if n < lengths[r]:
            rest = run(
                ours,
                [seqs[r][n:]],
                ckpt.conv_states[i : i + 1].clone(),
                ckpt.recurrent_states[i : i + 1].clone(),
                [True],
            )[0]
            torch.testing.assert_close(rest, outs[r][n:], atol=ATOL, rtol=0)


def test_checkpoints_need_positions(layers) -> None:
    _, ours = layers
    batch = RecurrentBatch(torch.tensor([0, 3]), torch.tensor([False]))
    conv, rec = torch.zeros(1, 3, 64), torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        ours.advance_with_checkpoints(torch.randn(3, HIDDEN), batch, conv, rec, 8)


@torch.no_grad()
def test_bfloat16_weights_and_states_track_float32(config, layers) -> None:
    """bf16 params, activations and conv state with a float32 recurrent state stay close to float32."""
    _, ours = layers
    low = GatedDeltaNet(ours.dims, params_dtype=torch.bfloat16)
    low.load_weights(ours.state_dict().items())
    torch.manual_seed(8)
    x = torch.randn(20, HIDDEN)
    conv_shape, rec_shape = shapes(config)
    ref = run(ours, [x], torch.zeros(1, *conv_shape), torch.zeros(1, *rec_shape), [False])[0]
    conv, rec = torch.zeros(1, *conv_shape, dtype=torch.bfloat16), torch.zeros(1, *rec_shape)
    out = run(low, [x.bfloat16()], conv, rec, [False])[0]
    assert out.dtype == torch.bfloat16 and conv.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)
