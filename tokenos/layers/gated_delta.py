"""Gated DeltaNet (Qwen3-Next linear attention) over a varlen batch of requests with per-request state.

Idea: a linear-attention layer whose memory is a matrix ``S [num_v_heads, head_k_dim, head_v_dim]`` per
request, updated by the gated delta rule::

    S <- exp(g_t) S                       (forget: g = -exp(A_log) * softplus(a + dt_bias) <= 0)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   (write only what S does not already predict for k_t)
    o_t = S^T q_t                          (q, k l2-normalized, q scaled by head_k_dim ** -0.5)

Around it: ``in_proj_qkvz`` / ``in_proj_ba`` projections (transformers' head-grouped layout), a short
causal conv with a rolling state over ``[q; k; v]``, a per-head gated RMSNorm (norm, then ``* silu(z)``)
and ``out_proj``. One-token requests take the recurrent step; longer ones the chunked form (a WY/UT
transform inside each chunk, a sequential pass carrying ``S`` across chunks), from the given state. State
tensors are read and written in place; the interface equals ``tokenos.layers.mamba2.Mamba2Mixer``'s.
Semantics follow transformers' ``Qwen3NextGatedDeltaNet`` torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenos.layers.causal_conv import causal_conv1d_varlen
from tokenos.layers.chunked_scan import ChunkLayout, advance_states, make_checkpoints
from tokenos.layers.recurrent import RecurrentLayer, first_attr
from tokenos.layers.recurrent_batch import RecurrentBatch, StateCheckpoints
from tokenos.layers.weights import WeightHolder, make_param


@dataclass(frozen=True)
class GatedDeltaDims:
    """Everything the layer needs from a model config, under one spelling."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float = 1e-6
    chunk_size: int = 64

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_config(cls, config: object) -> GatedDeltaDims:
        """Read a transformers Qwen3NextConfig (``linear_*`` names)."""
        dims = cls(
            hidden_size=int(config.hidden_size),
            num_k_heads=int(config.linear_num_key_heads),
            num_v_heads=int(config.linear_num_value_heads),
            head_k_dim=int(config.linear_key_head_dim),
            head_v_dim=int(config.linear_value_head_dim),
            conv_kernel=int(config.linear_conv_kernel_dim),
            eps=float(first_attr(config, "rms_norm_eps", default=1e-6)),
        )
        act = first_attr(config, "hidden_act", default="silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"gated DeltaNet conv activation {act!r} is not supported (only silu)")
        if dims.num_v_heads % dims.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {dims.num_v_heads} must be a multiple of "
                f"linear_num_key_heads {dims.num_k_heads}"
            )
        return dims


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim (the FLA / transformers form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layout: ChunkLayout,
    initial_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over the prefill requests of ``layout``.

    Args (flat over all tokens; only ``layout.token_src`` rows are read; q already normalized and scaled):
        q/k ``[T, H, K]``, v ``[T, H, V]``, g/beta ``[T, H]``, initial_states ``[num_prefill, H, K, V]``.
    Returns:
        o ``[len(token_src), H, V]`` and boundary states ``[num_prefill, max_chunks + 1, H, K, V]``
        (``[:, 0]`` initial, ``[:, j + 1]`` after the request's chunk ``j``).
    """
    # [n, H, c, D]: identity tokens have k = v = beta = g = 0, so they neither write nor decay.
    qc, kc, vc = (layout.to_chunks(t).transpose(1, 2) for t in (q, k, v))
    gc, bc = (layout.to_chunks(t).transpose(1, 2) for t in (g, beta))
    c = layout.chunk_size
    cum = gc.cumsum(dim=-1)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, -torch.inf).exp()
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    # UT transform: (I + strict_lower(beta K K^T * decay)) turns the chunk's sequential delta updates into
    # matmuls: u = T^-1 (beta V) are the values to write, w = T^-1 (beta K exp(cum)) read the chunk-start S.
    ut = (k_beta @ kc.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    out = torch.zeros_like(u)
    state = initial_states
    boundary = [state]
    for j in range(layout.chunk_table.shape[1]):
        ids = layout.chunk_table[:, j]
        v_new = u[ids] - w[ids] @ state
        out[ids] = q_decayed[ids] @ state + intra[ids] @ v_new
        state = state * chunk_decay[ids] + k_to_end[ids].transpose(-1, -2) @ v_new
        boundary.append(state)
    return layout.from_chunks(out.transpose(1, 2)), torch.stack(boundary, dim=1)


def gated_delta_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: state ``[R, H, K, V]``, q/k ``[R, H, K]``, v ``[R, H, V]``, g/beta ``[R, H]``.
    Returns ``(o [R, H, V], new state)``."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("rhkv,rhk->rhv", state, k)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return torch.einsum("rhkv,rhk->rhv", state, q), state


class GatedDeltaNet(RecurrentLayer):
    """Qwen3-Next's linear-attention layer; parameter names and shapes equal transformers'
    (``in_proj_qkvz.weight``, ``in_proj_ba.weight``, ``conv1d.weight`` ``[conv_dim, 1, K]``, ``dt_bias``,
    ``A_log``, ``norm.weight`` ``[head_v_dim]``, ``out_proj.weight``)."""

    dims_type = GatedDeltaDims

    def __init__(self, config: object, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        d = self.dims_of(config)
        self.dims = d
        self.in_proj_qkvz = WeightHolder((2 * d.key_dim + 2 * d.value_dim, d.hidden_size), None, params_dtype)
        self.in_proj_ba = WeightHolder((2 * d.num_v_heads, d.hidden_size), None, params_dtype)
        self.conv1d = WeightHolder((d.conv_dim, 1, d.conv_kernel), None, params_dtype)
        self.dt_bias = make_param(d.num_v_heads, dtype=params_dtype)
        self.A_log = make_param(d.num_v_heads, dtype=params_dtype)
        self.norm = WeightHolder((d.head_v_dim,), None, params_dtype)
        self.out_proj = WeightHolder((d.hidden_size, d.value_dim), None, params_dtype)

    @staticmethod
    def _state_shapes(d: GatedDeltaDims) -> tuple[tuple[int, ...], ...]:
        """``((K - 1, conv_dim), (num_v_heads, head_k_dim, head_v_dim))``."""
        return ((d.conv_kernel - 1, d.conv_dim), (d.num_v_heads, d.head_k_dim, d.head_v_dim))

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split transformers' head-grouped projections: each key head's group holds
        ``[q, k, v (ratio heads), z (ratio heads)]`` and ``[b (ratio), a (ratio)]``."""
        d = self.dims
        n = hidden_states.shape[0]
        ratio = d.num_v_heads // d.num_k_heads
        qkvz = F.linear(hidden_states, self.in_proj_qkvz.weight).view(n, d.num_k_heads, -1)
        q, k, v, z = qkvz.split([d.head_k_dim, d.head_k_dim, ratio * d.head_v_dim, ratio * d.head_v_dim], -1)
        b, a = F.linear(hidden_states, self.in_proj_ba.weight).view(n, d.num_k_heads, -1).split(ratio, -1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, d.num_v_heads, d.head_v_dim), b.reshape(n, -1), a.reshape(n, -1)

    def _run(
        self,
        hidden_states: torch.Tensor,
        batch: RecurrentBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        checkpoint_every: int | None,
    ) -> tuple[torch.Tensor, StateCheckpoints | None]:
        d = self.dims
        n = hidden_states.shape[0]
        if n != batch.num_tokens:
            raise ValueError(f"hidden_states has {n} tokens, the batch {batch.num_tokens}")
        mixed, z, b, a = self._project(hidden_states)
        positions = batch.snapshot_positions(checkpoint_every)
        mixed, conv_snaps = causal_conv1d_varlen(
            mixed, self.conv1d.weight[:, 0], None, conv_state, batch, positions
        )
        # A 16-bit model rounds to its dtype where transformers does: the conv output, beta and the core
        # output (also where the FLA / vLLM kernels hand tensors over) and the normalized output
        # (transformers' own); all else stays float32, and each `.to(dtype)` is free in float32. One
        # rounding differs: transformers' conv also rounds before its SiLU, the shared conv does not
        # (<= 1 ulp of the conv output).
        dtype = hidden_states.dtype
        mixed = mixed.to(dtype).float()
        q, k, v = mixed.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        ratio = d.num_v_heads // d.num_k_heads
        # Value head h reads key head h // ratio (transformers' repeat_interleave).
        q = l2norm(q.reshape(n, d.num_k_heads, d.head_k_dim)).repeat_interleave(ratio, dim=1)
        q = q * d.head_k_dim**-0.5
        k = l2norm(k.reshape(n, d.num_k_heads, d.head_k_dim)).repeat_interleave(ratio, dim=1)
        v = v.reshape(n, d.num_v_heads, d.head_v_dim)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

        o = torch.zeros_like(v, dtype=torch.float32)

        def step(state: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return gated_delta_step(state, q[tok], k[tok], v[tok].float(), g[tok], beta[tok])

        def scan(layout: ChunkLayout, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return chunk_gated_delta_rule(q, k, v, g, beta, layout, initial)

        states = advance_states(batch, recurrent_state, o, d.chunk_size, checkpoint_every, step, scan)
        o = o.to(dtype).float()
        o = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + d.eps)).to(dtype) * self.norm.weight
        o = (o.float() * F.silu(z.float())).reshape(n, d.value_dim)
        out = F.linear(o.to(dtype), self.out_proj.weight)
        if positions is None:
            return out, None
        return out, make_checkpoints(batch, positions, conv_snaps, states)
