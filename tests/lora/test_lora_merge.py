"""The merged path: a linear running one adapter merged into its base weight gives what the base plus
the adapter's delta gives, for plain and oneDNN-packed weights in both dtypes; quantized weights are
never merged; the manager merges only after a run of steps that one adapter has to itself."""

from __future__ import annotations

import pytest
import torch

import tokenos.lora.manager as manager_module
from tokenos.config import LoRAConfig
from tokenos.layers.linear import Linear, packing_enabled
from tokenos.lora.adapter import ModuleWeights, Piece
from tokenos.lora.layers import LoRALayer, LoRAStep, apply_torch


def _linear(k: int, n: int, dtype: torch.dtype, how: str, gen) -> Linear:
    linear = Linear(k, n, bias=True)
    linear.weight.data = torch.randn(n, k, generator=gen).to(dtype)
    linear.bias.data = torch.randn(n, generator=gen).to(dtype)
    if how == "packed":
        if not packing_enabled():
            pytest.skip("oneDNN packing is off")
        linear.pack()
        assert linear.packed is not None
    elif how == "int8":
        linear.pack("int8")
        assert linear.quantized is not None
    return linear


def _adapter(k: int, gen, dtype: torch.dtype) -> ModuleWeights:
    """Two pieces over a [40, k] output, the middle 8 columns left alone."""
    a = torch.randn(6, k, generator=gen).to(dtype) * 0.3
    pieces = [
        Piece(0, 16, 0, 4, torch.randn(4, 16, generator=gen).to(dtype) * 0.3),
        Piece(24, 16, 4, 2, torch.randn(2, 16, generator=gen).to(dtype) * 0.3),
    ]
    return ModuleWeights(a, pieces)


def _adapted(seed: int, dtype: torch.dtype, how: str) -> tuple[Linear, LoRAStep, LoRALayer, torch.Generator]:
    """A [40, 48] linear (``how`` its base weights) with adapter "a" hooked on."""
    gen = torch.Generator().manual_seed(seed)
    linear = _linear(48, 40, dtype, how, gen)
    step = LoRAStep()
    layer = linear.lora = LoRALayer(step, linear)
    layer.add("a", _adapter(48, gen, dtype))
    return linear, step, layer, gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["plain", "packed"])
def test_merged_linear_equals_base_plus_delta(dtype, how):
    linear, step, layer, gen = _adapted(3, dtype, how)
    before = linear.dense_weight().clone()
    x = torch.randn(5, 48, generator=gen).to(dtype)
    want = linear.base_forward(x).float()
    apply_torch(x.float(), want, layer.weights["a"])  # the float32 delta, exactly
    step.set([("a", 0, 5)], merged="a")
    got = linear(x)
    assert layer.merged_key == "a" and layer.merged is not None
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))
    assert torch.equal(linear.dense_weight(), before)  # the base weight is untouched
    step.set([("a", 0, 2)])  # not merged: the segment path, base rows untouched
    unmerged = linear(x)
    torch.testing.assert_close(unmerged[:2].float(), want[:2], rtol=tol, atol=tol * float(want.abs().max()))
    assert torch.equal(unmerged[2:], linear.base_forward(x)[2:])


def test_quantized_base_weights_are_not_merged():
    linear, step, layer, gen = _adapted(4, torch.float32, "int8")
    x = torch.randn(3, 48, generator=gen)
    want = linear.base_forward(x)
    apply_torch(x, want, layer.weights["a"])
    step.set([("a", 0, 3)], merged="a")
    torch.testing.assert_close(linear(x), want)  # the segment path
    assert layer.merged is None


def test_dropping_an_adapter_drops_its_merged_copy():
    linear, step, layer, gen = _adapted(5, torch.float32, "plain")
    step.set([("a", 0, 1)], merged="a")
    linear(torch.randn(1, 48, generator=gen))
    assert layer.merged is not None
    layer.drop("a")
    assert layer.merged is None and layer.merged_key is None and not layer.weights


class _Manager(manager_module.LoRAManager):
    """The manager's step logic alone (no model): every key counts as loaded."""

    def __init__(self, merge: bool = True) -> None:
        self.config = LoRAConfig(max_loras=2, merge_single_adapter=merge)
        self.step = LoRAStep()
        self.loaded = {"a": {}, "b": {}}
        self.merged = None
        self.single = (None, 0)


def _merged_per_step(manager, steps) -> list[str | None]:
    out = []
    for segments, num_tokens in steps:
        manager.set_step(segments, num_tokens)
        out.append(manager.step.merged)
    return out


def test_the_manager_merges_after_a_run_of_steps_one_adapter_has_alone():
    after = manager_module.MERGE_AFTER_STEPS
    alone_a, alone_b = ([("a", 0, 4)], 4), ([("b", 0, 4)], 4)
    mixed = ([("a", 2, 4)], 4)  # base-model rows at 0-1
    m = _Manager()
    assert _merged_per_step(m, [alone_a] * after) == [None] * (after - 1) + ["a"]
    # A mixed step runs unmerged; back alone, "a" (its copies still held) runs merged at once.
    assert _merged_per_step(m, [mixed, alone_a]) == [None, "a"]
    # Another adapter alone waits for its own run before its copies replace a's.
    assert _merged_per_step(m, [alone_b] * after) == [None] * (after - 1) + ["b"]
    assert _merged_per_step(m, [([("a", 0, 2), ("b", 2, 4)], 4)]) == [None]
    assert _merged_per_step(_Manager(merge=False), [alone_a] * (after + 2)) == [None] * (after + 2)
