"""Packed linears (tokenos/layers/linear.py): the oneDNN-packed path matches the plain F.linear
reference over shapes and dtypes, and packing is undone by nothing but TOKENOS_PACK_LINEARS=0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenos.layers.embedding import LMHead, VocabEmbedding
from tokenos.layers.linear import Linear, MergedLinear, packing_enabled

pytestmark = pytest.mark.skipif(not packing_enabled(), reason="oneDNN is not available")

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _linear(cls, dtype, *args, bias):
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = cls(*args, bias=bias)
    finally:
        torch.set_default_dtype(previous)
    for p in layer.parameters():
        p.data.normal_(0, 0.05)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias):
    layer = _linear(Linear, dtype, 96, 136, bias=bias)
    weight = layer.weight.detach().clone()
    b = None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(rows, 96).to(dtype)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    layer.pack()
    assert layer.weight is None and layer.packed is not None
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 136)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_packed_merged_linear_keeps_its_shards_and_3d_inputs():
    layer = _linear(MergedLinear, torch.float32, 32, [48, 48], bias=False)
    weight = layer.weight.detach().clone()
    x = torch.randn(5, 32)
    layer.pack()
    torch.testing.assert_close(layer(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_packed_lm_head(tied):
    torch.manual_seed(0)
    embed = VocabEmbedding(300, 64)
    embed.weight.data.normal_()
    head = LMHead(300, 64, tied_to=embed if tied else None)
    if not tied:
        head.weight.data.normal_()
    weight = head.weight.detach().clone()
    hidden = torch.randn(4, 64)
    head.pack()
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight), atol=1e-4, rtol=1e-4)
    # A tied head's embedding still looks tokens up; an untied head's plain weight is gone.
    if tied:
        assert head.weight is embed.weight
        torch.testing.assert_close(embed(torch.tensor([3])), weight[3:4])
    else:
        assert head.weight is None


def test_packing_is_off_with_the_environment_switch(monkeypatch):
    monkeypatch.setenv("TOKENOS_PACK_LINEARS", "0")
    layer = _linear(Linear, torch.float32, 8, 8, bias=False)
    layer.pack()
    assert layer.packed is None and layer.weight is not None
