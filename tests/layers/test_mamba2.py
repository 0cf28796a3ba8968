"""Mamba2 mixer parity with transformers' pure-torch Mamba2Mixer, and state-carrying invariants.

Every test compares our varlen, state-in-place mixer with transformers' reference (or with itself run
differently): full prefill, odd-sized splits, decode, mixed batches over a state pool, checkpoints.
"""

import pytest
import torch
from transformers import Mamba2Config
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

from tests.fixtures.recurrent import (
    check_checkpoints_equal_split_states_and_resume,
    check_full_prefill_matches,
    check_mixed_batch_over_pool_equals_each_alone,
    check_prefill_then_decode_matches,
    check_split_prefill_equals_one_pass,
    nan_states,
    run,
)
from tokenos.layers.mamba2 import Mamba2Dims, Mamba2Mixer

ATOL = 1e-4
HIDDEN = 16


@pytest.fixture(scope="module")
def config() -> Mamba2Config:
    # 4 heads in 2 groups, chunk 8 so short sequences already span several chunks.
    return Mamba2Config(
        num_heads=4,
        head_dim=8,
        hidden_size=HIDDEN,
        expand=2,
        state_size=8,
        n_groups=2,
        chunk_size=8,
        conv_kernel=4,
        num_hidden_layers=1,
        vocab_size=32,
    )


@pytest.fixture(scope="module")
def layers(config: Mamba2Config) -> tuple[HFMamba2Mixer, Mamba2Mixer]:
    torch.manual_seed(0)
    hf = HFMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        hf.D.copy_(torch.randn_like(hf.D))
        hf.norm.weight.copy_(1 + 0.2 * torch.randn_like(hf.norm.weight))
        hf.conv1d.bias.copy_(0.2 * torch.randn_like(hf.conv1d.bias))
    ours = Mamba2Mixer(config)
    loaded = ours.load_weights(hf.state_dict().items())
    assert loaded == {name for name, _ in ours.named_parameters()}
    return hf, ours


def state_shapes(config: Mamba2Config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shapes, dtypes = Mamba2Mixer.state_shapes(config)
    assert dtypes == ("float32", "float32")
    return shapes


def fresh_states(config: Mamba2Config, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return nan_states(state_shapes(config), n)


def test_state_shapes_and_dims(config: Mamba2Config) -> None:
    dims = Mamba2Dims.from_config(config)
    assert dims.conv_dim == 2 * HIDDEN + 2 * 2 * 8
    assert state_shapes(config) == ((3, dims.conv_dim), (4, 8, 8))


def test_full_prefill_matches_transformers(config, layers) -> None:
    hf, ours = layers
    check_full_prefill_matches(hf, ours, config, state_shapes(config), HIDDEN, 37, seed=1, atol=ATOL)


@torch.no_grad()
@pytest.mark.parametrize("chunk", [5, 3, 64])
def test_scan_chunk_size_is_free(config, layers, chunk) -> None:
    """Our chunking need not match transformers' (8): odd chunk sizes give the same outputs."""
    hf, ours = layers
    other = Mamba2Mixer(Mamba2Dims(**{**ours.dims.__dict__, "chunk_size": chunk}))
    other.load_weights(ours.state_dict().items())
    torch.manual_seed(7)
    x = torch.randn(1, 29, HIDDEN)
    conv, ssm = fresh_states(config, 1)
    torch.testing.assert_close(run(other, [x[0]], conv, ssm, [False])[0], hf(x)[0], atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("pieces", [[1, 7, 13, 2, 17], [3, 1, 1, 30, 1], [8, 8, 9, 10]])
def test_split_prefill_equals_one_pass(config, layers, pieces) -> None:
    check_split_prefill_equals_one_pass(layers[1], state_shapes(config), HIDDEN, pieces, seed=2, atol=ATOL)


def test_prefill_then_decode_matches_transformers(config, layers) -> None:
    hf, ours = layers
    shapes = state_shapes(config)
    check_prefill_then_decode_matches(hf, ours, config, shapes, HIDDEN, 11, 6, seed=3, atol=ATOL)


def test_mixed_batch_over_pool_equals_each_alone(config, layers) -> None:
    # A pool of 10 slots; requests live at scattered slots, the rest must stay untouched.
    shapes = state_shapes(config)
    check_mixed_batch_over_pool_equals_each_alone(layers[1], shapes, HIDDEN, 0.5, seed=4, atol=ATOL)


@pytest.mark.parametrize("every", [8, 12, 4])
def test_checkpoints_equal_split_states_and_resume(config, layers, every) -> None:
    # Two requests resuming mid-sequence (5 and 16 tokens already folded in) plus one decode.
    check_checkpoints_equal_split_states_and_resume(
        layers[1], state_shapes(config), HIDDEN, 0.5, [5, 16, 11], [30, 17, 1], every, seed=5, atol=ATOL
    )


@torch.no_grad()
def test_time_step_limit_applies_to_decode_too(config, layers) -> None:
    _, ours = layers
    limited = Mamba2Mixer(Mamba2Dims(**{**ours.dims.__dict__, "time_step_limit": (0.05, 0.3)}))
    limited.load_weights(ours.state_dict().items())
    torch.manual_seed(6)
    x = torch.randn(12, HIDDEN)
    conv1, ssm1 = fresh_states(config, 1)
    whole = run(limited, [x], conv1, ssm1, [False])[0]
    conv2, ssm2 = fresh_states(config, 1)
    steps = [run(limited, [x[t : t + 1]], conv2, ssm2, [t > 0])[0] for t in range(12)]
    torch.testing.assert_close(torch.cat(steps), whole, atol=ATOL, rtol=0)


def test_load_weights_rejects_unknown_and_misshapen(layers) -> None:
    _, ours = layers
    with pytest.raises(ValueError, match="no matching parameter"):
        ours.load_weights([("mixer.in_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError):
        ours.load_weights([("D", torch.zeros(3))])
    # A squeezed conv weight [C, K] loads into [C, 1, K].
    w = torch.randn(ours.conv1d.weight.shape[0], ours.conv1d.weight.shape[2])
    saved = ours.conv1d.weight.detach().clone()
    ours.load_weights([("conv1d.weight", w)])
    assert torch.equal(ours.conv1d.weight[:, 0], w)
    ours.load_weights([("conv1d.weight", saved)])


@torch.no_grad()
def test_bfloat16_weights_and_states_track_float32(config, layers) -> None:
    """bf16 params, activations and conv state with a float32 SSM state stay close to float32."""
    _, ours = layers
    low = Mamba2Mixer(config, params_dtype=torch.bfloat16)
    low.load_weights(ours.state_dict().items())
    torch.manual_seed(8)
    x = torch.randn(20, HIDDEN)
    conv_shape, ssm_shape = state_shapes(config)
    ref = run(ours, [x[:13]], torch.zeros(1, *conv_shape), torch.zeros(1, *ssm_shape), [False])[0]
    conv, ssm = torch.zeros(1, *conv_shape, dtype=torch.bfloat16), torch.zeros(1, *ssm_shape)
    out = run(low, [x[:13].bfloat16()], conv, ssm, [False])[0]
    assert out.dtype == torch.bfloat16 and conv.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)
