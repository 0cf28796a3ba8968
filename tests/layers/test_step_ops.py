"""The fused step ops (csrc/step_ops.c: residual add + RMSNorm, SiLU-and-mul, rotary in place)
against their torch reference paths, over random shapes, partial rotary and both dtypes. bf16
results round where the torch ops round, so they agree to the last bit almost everywhere (the
norm's float32 sum runs in a different order: an ulp, rarely)."""

from __future__ import annotations

import pytest
import torch

from tokenos.layers import cpu_kernels
from tokenos.layers.activation import SiluAndMul
from tokenos.layers.layernorm import RMSNorm
from tokenos.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="C kernels unavailable")

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=0.0, rtol=8e-3)}


def reference(monkeypatch, fn):
    """fn() computed by the torch path (the kernels switched off for the call)."""
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "usable", lambda *tensors: False)
        return fn()


def assert_close_mostly_exact(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got, want, **TOL[dtype])
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (300, 96), (2048, 40)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(monkeypatch, dtype, rows, hidden, with_residual):
    torch.manual_seed(rows + hidden)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x = (3 * torch.randn(rows, hidden)).to(dtype)
    residual = torch.randn(rows, hidden).to(dtype) if with_residual else None
    args = (x,) if residual is None else (x, residual)
    got = norm(*args)
    want = reference(monkeypatch, lambda: norm(*args))
    if residual is None:
        got, want = (got,), (want,)
    assert len(got) == len(want)  # (normed, new residual) with a residual
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == (rows, hidden)
        assert_close_mostly_exact(g, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (64, 2 * 96), (5, 3, 2 * 40)])
def test_silu_and_mul(monkeypatch, dtype, shape):
    torch.manual_seed(sum(shape))
    x = (4 * torch.randn(*shape)).to(dtype)
    x[0, ..., 0] = -200.0  # saturating exp
    x[0, ..., 1] = 200.0
    act = SiluAndMul()
    got = act(x)
    want = reference(monkeypatch, lambda: act(x))
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    assert_close_mostly_exact(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,rotary_dim", [(9, 3, 64, None), (4, 4, 32, 16), (2, 1, 128, 64)]
)
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_in_place_on_qkv_views(monkeypatch, dtype, heads, kv_heads, head_dim, rotary_dim, tokens):
    torch.manual_seed(heads * tokens)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, rotary_dim=rotary_dim)
    positions = torch.randint(0, 4096, (tokens,))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim

    def split():
        qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=torch.Generator().manual_seed(7)).to(dtype)
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)

    cos_sin = rope.cos_sin(positions, dtype)
    got_q, got_k = rope(cos_sin, *split())
    want_q, want_k = reference(monkeypatch, lambda: rope(cos_sin, *split()))
    assert_close_mostly_exact(got_q, want_q, dtype)
    assert_close_mostly_exact(got_k, want_k, dtype)
