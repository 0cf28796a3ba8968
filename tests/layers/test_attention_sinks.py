"""Attention sinks (gpt-oss): an `Attention` with ``sinks`` against a dense float64 reference over prefills,
chunks after a cached prefix and decodes of mixed lengths, with and without a window, on the torch path
and through the C decode kernel; and zero-valued sinks are not the same as none (the sink still takes its
exp(0) share of the denominator)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.layers.test_attention import KVH, D, H, run_steps
from tokenos.layers import cpu_kernels
from tokenos.layers.attention import Attention, allocate_kv_cache

STEPS = [
    {0: 3, 1: 17, 2: 1, 3: 30},  # fresh prefills, one single-token prompt
    {1: 1, 0: 5, 3: 1, 2: 1},  # decodes of different lengths + a chunk after a cached prefix
    {3: 1, 0: 1, 1: 2, 2: 1},
    {2: 1, 3: 1, 1: 1, 0: 1},
]


def reference_with_sinks(q, k, v, window, sinks):
    """Every query of one request (positions 0..n-1) in float64: softmax over [scores, sink], sink dropped."""
    k = k.double().repeat_interleave(H // KVH, dim=1)
    v = v.double().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * D**-0.5
    q_pos, k_pos = torch.arange(q.shape[0])[:, None], torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.double()[:, None, None].expand(H, q.shape[0], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def run(attn: Attention) -> dict[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cache = allocate_kv_cache(80, 4, KVH, D, torch.float32)
    history = {r: {"k": torch.empty(0, KVH, D)} for r in range(4)}
    run_steps(attn, cache, 4, STEPS, history, random.Random(0))
    return history


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("c_kernels", [False, True], ids=["torch", "c"])
def test_sinks_match_the_dense_reference(window, c_kernels, monkeypatch):
    """Both the explicit torch path and the C decode kernel (float32 pages: the prefill kernel takes bf16
    only, so prefills stay on the torch path here) fold the sinks as the dense reference does."""
    calls = []
    if c_kernels:
        if cpu_kernels.load() is None:
            pytest.skip("no C compiler")
        real = cpu_kernels.paged_decode
        monkeypatch.setattr(cpu_kernels, "paged_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    else:
        monkeypatch.setattr("tokenos.layers.attention._use_c_kernel", lambda kv_cache: False)
    sinks = torch.tensor([2.0, -1.0, 0.5, 3.0])
    attn = Attention(H, KVH, D, D**-0.5, sliding_window=window, sinks=sinks)
    assert attn.explicit
    for h in run(attn).values():
        expected = reference_with_sinks(h["q"], h["k"], h["v"], window, sinks)
        torch.testing.assert_close(h["out"].double(), expected, atol=1e-5, rtol=1e-5)
    assert bool(calls) == c_kernels


def test_zero_sinks_still_take_a_share():
    plain = run(Attention(H, KVH, D, D**-0.5))
    zero = run(Attention(H, KVH, D, D**-0.5, sinks=torch.zeros(H)))
    for r, h in zero.items():
        assert not torch.allclose(plain[r]["out"], h["out"], atol=1e-3)
        expected = reference_with_sinks(h["q"], h["k"], h["v"], None, torch.zeros(H))
        torch.testing.assert_close(h["out"].double(), expected, atol=1e-5, rtol=1e-5)
