"""Gated DeltaNet parity with transformers' pure-torch Qwen3NextGatedDeltaNet, and state invariants.

Our layer runs with chunk size 16 (transformers uses 64), so short sequences cross several chunks and the
parity tests also show the result does not depend on the chunking.
"""

import dataclasses

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from tests.fixtures.recurrent import (
    check_checkpoints_equal_split_states_and_resume,
    check_full_prefill_matches,
    check_mixed_batch_over_pool_equals_each_alone,
    check_prefill_then_decode_matches,
    check_split_prefill_equals_one_pass,
    run,
)
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


def test_full_prefill_matches_transformers(config, layers) -> None:
    hf, ours = layers
    check_full_prefill_matches(hf, ours, config, shapes(config), HIDDEN, 45, seed=2, atol=ATOL)


@torch.no_grad()
@pytest.mark.parametrize("pieces", [[1, 7, 13, 2, 17], [3, 1, 1, 30, 1], [16, 16, 17, 5]])
def test_split_prefill_equals_one_pass(config, layers, pieces) -> None:
    check_split_prefill_equals_one_pass(layers[1], shapes(config), HIDDEN, pieces, seed=3, atol=ATOL)


def test_prefill_then_decode_matches_transformers(config, layers) -> None:
    hf, ours = layers
    check_prefill_then_decode_matches(hf, ours, config, shapes(config), HIDDEN, 21, 6, seed=4, atol=ATOL)


def test_mixed_batch_over_pool_equals_each_alone(config, layers) -> None:
    check_mixed_batch_over_pool_equals_each_alone(layers[1], shapes(config), HIDDEN, 0.3, seed=5, atol=ATOL)


@pytest.mark.parametrize("every", [16, 24, 8])
def test_checkpoints_equal_split_states_and_resume(config, layers, every) -> None:
    check_checkpoints_equal_split_states_and_resume(
        layers[1], shapes(config), HIDDEN, 0.3, [5, 16, 23], [50, 17, 1], every, seed=6, atol=ATOL
    )


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
