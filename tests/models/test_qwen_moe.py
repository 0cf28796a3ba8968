"""Qwen2-MoE and Qwen3-MoE beyond the shared dense parity cases (tests/models/test_parity.py, ``-k moe``):
the grouped expert computation against a per-token reference, which layers are sparse, the per-expert
checkpoint tensors landing in their stacked slots (and a missing one refused), and transformers' greedy
tokens through `LLM` under a small chunked-prefill budget, in mixed batches and with n > 1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.fixtures.checkpoints import LLM_SHAPE, load_ours, save_tiny
from tests.fixtures.llm import DENSE, make_llm
from tokenos.models.qwen_moe import QwenSparseMoe, StackedExperts, route


def per_token_reference(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The plain definition: for every token and each of its k experts, the expert's MLP, weighted."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(chosen.shape[1]):
            e = int(chosen[t, k])
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += weights[t, k] * F.linear(F.silu(gate) * up, down[e])
    return out


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 4, 2), (37, 8, 2), (64, 6, 3), (5, 16, 4)])
def test_grouped_experts_match_per_token_reference(tokens, num_experts, top_k):
    torch.manual_seed(tokens)
    hidden, size = 24, 20
    experts = StackedExperts(num_experts, hidden, size, torch.float32)
    experts.gate_up_proj.weight.data.normal_()
    experts.down_proj.weight.data.normal_()
    x = torch.randn(tokens, hidden)
    weights, chosen = route(
        torch.randn(tokens, num_experts), top_k, norm_topk_prob=tokens % 2 == 1, dtype=x.dtype
    )
    got = experts(x, chosen, weights)
    want = per_token_reference(x, chosen, weights, experts.gate_up_proj.weight, experts.down_proj.weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_grouped_experts_with_no_tokens():
    experts = StackedExperts(4, 8, 6, torch.float32)
    experts.gate_up_proj.weight.data.normal_()
    experts.down_proj.weight.data.normal_()
    empty = torch.zeros(0, 2, dtype=torch.long)
    assert experts(torch.zeros(0, 8), empty, torch.zeros(0, 2)).shape == (0, 8)


def test_route_renormalises_only_when_asked():
    logits = torch.randn(10, 6)
    raw, chosen = route(logits, 2, False, torch.float32)
    normed, chosen2 = route(logits, 2, True, torch.float32)
    assert torch.equal(chosen, chosen2)
    torch.testing.assert_close(normed.sum(-1), torch.ones(10))
    assert (raw.sum(-1) < 1).all()
    torch.testing.assert_close(normed, raw / raw.sum(-1, keepdim=True))


@pytest.mark.parametrize(
    "family,overrides,sparse",
    [
        ("qwen2_moe", {}, [True, False]),  # mlp_only_layers=[1]
        ("qwen3_moe", {}, [False, True]),  # decoder_sparse_step=2
        ("qwen3_moe", {"decoder_sparse_step": 1}, [True, True]),
    ],
)
def test_sparse_and_dense_layers_and_stacked_weights(tmp_path, family, overrides, sparse):
    folder = str(tmp_path / family)
    ref = save_tiny(family, folder, **overrides)
    model, _ = load_ours(folder)
    assert [isinstance(layer.mlp, QwenSparseMoe) for layer in model.stack.layers] == sparse
    state = ref.state_dict()
    i = sparse.index(True)
    moe = model.stack.layers[i].mlp
    assert hasattr(moe, "shared_expert") == (family == "qwen2_moe")
    # transformers holds its experts stacked too ([E, 2I, H] gate|up, [E, H, I] down); ours must equal them.
    torch.testing.assert_close(
        moe.experts.gate_up_proj.weight, state[f"model.layers.{i}.mlp.experts.gate_up_proj"]
    )
    torch.testing.assert_close(moe.experts.down_proj.weight, state[f"model.layers.{i}.mlp.experts.down_proj"])


def test_missing_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path / "qwen2_moe")
    save_tiny("qwen2_moe", folder)
    path = f"{folder}/model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj\.weight"):
        load_ours(folder)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_greedy_parity_chunked_prefill_mixed_batch_and_n_samples(tmp_path, family):
    folder = str(tmp_path / family)
    ref = save_tiny(family, folder, **LLM_SHAPE)
    # Several prompts at once, each over several 8-token chunks: prefill chunks and decodes share steps.
    prompts = DENSE.prompts(4, 5, 40, seed=21)
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=8)
    DENSE.check(DENSE.run(llm, prompts), prompts, ref)
    prompts = DENSE.prompts(2, 6, 30, seed=5)
    outputs = DENSE.run(llm, prompts, n=3)
    assert all(len(out.outputs) == 3 for out in outputs)
    DENSE.check(outputs, prompts, ref)  # greedy: every one of the n completions is the reference's


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_online_quantization_quantizes_the_experts(method):
    """``--quantization int8 / int4`` quantizes each expert like any linear: the grouped computation on
    the quantized experts equals the per-token reference on their dequantized weights."""
    from tokenos.layers.quantization import quantize

    torch.manual_seed(0)
    experts = StackedExperts(4, 32, 16, torch.float32)
    experts.gate_up_proj.weight.data.normal_()
    experts.down_proj.weight.data.normal_()
    bits = 8 if method == "int8" else 4
    gate_up = torch.stack([quantize(w, bits).dequantize() for w in experts.gate_up_proj.weight])
    down = torch.stack([quantize(w, bits).dequantize() for w in experts.down_proj.weight])
    experts.pack(method)
    assert experts.gate_up_proj.weight is None and len(experts.quantized["down_proj"]) == 4
    x = torch.randn(9, 32)
    weights, chosen = route(torch.randn(9, 4), 2, norm_topk_prob=True, dtype=x.dtype)
    torch.testing.assert_close(
        experts(x, chosen, weights),
        per_token_reference(x, chosen, weights, gate_up, down),
        atol=1e-4,
        rtol=1e-4,
    )
