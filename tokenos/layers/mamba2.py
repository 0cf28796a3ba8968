"""Mamba2 (SSD) mixer over a varlen batch of requests with per-request recurrent state.

Idea: the mixer is ``in_proj -> causal conv (rolling state) -> selective scan (SSM state) -> gated RMSNorm
-> out_proj``. Its whole history lives in two fixed-size tensors per request:

- conv state ``[conv_kernel - 1, conv_dim]``: the last ``K - 1`` conv inputs (token-major rows);
- SSM state ``[num_heads, head_dim, state_size]``: ``h_t = exp(dt_t * A) h_{t-1} + dt_t x_t B_t^T``.

A request with one new token takes the recurrent step; longer ones take the SSD chunked scan (intra-chunk
quadratic "attention" plus a sequential pass carrying state across chunks), starting from the given state;
the chunk is the config's ``chunk_size`` capped at ``SCAN_CHUNK_CAP``.
Both read and write the caller's state tensors in place, so any split of a sequence gives the same result
as one pass (up to float rounding). With ``forward_with_checkpoints`` the scan's chunks are aligned to
absolute positions and the states at multiples of a granularity come out of the same pass, for
prefix caching.

Semantics follow transformers' ``Mamba2Mixer`` torch path (and Bamba, GraniteMoeHybrid, NemotronH, which
share it), with one deliberate difference: ``time_step_limit`` clamps dt in the decode step too, so that
decode equals prefill for any limits (transformers clamps only in the chunked path; equal at the default
``(0, inf)``).
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

# The chunk length is a free parameter of the SSD scan (any value gives the same result up to rounding).
# Checkpoint configs use 128-256, tuned for GPU kernels; in torch on CPU the per-head quadratic part
# dominates there and 64 is about 2-3x faster.
SCAN_CHUNK_CAP = 64


@dataclass(frozen=True)
class Mamba2Dims:
    """Everything the mixer needs from a model config, under one spelling."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_bias: bool = False
    use_conv_bias: bool = True
    eps: float = 1e-5
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    activation: str = "silu"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @classmethod
    def from_config(cls, config: object) -> Mamba2Dims:
        """Read a transformers Mamba2 / Bamba / GraniteMoeHybrid / NemotronH config (mamba_* names first,
        since hybrid configs also carry attention's ``head_dim``)."""
        # NemotronH too: an older transformers mixer clamped its dt at time_step_min instead, but
        # transformers 5.25 (the parity reference CI installs) takes time_step_limit like Mamba2.
        limit = tuple(first_attr(config, "time_step_limit", default=(0.0, float("inf"))))
        dims = cls(
            hidden_size=int(config.hidden_size),
            num_heads=int(first_attr(config, "mamba_n_heads", "mamba_num_heads", "num_heads")),
            head_dim=int(first_attr(config, "mamba_d_head", "mamba_head_dim", "head_dim")),
            state_size=int(first_attr(config, "mamba_d_state", "ssm_state_size", "state_size")),
            n_groups=int(first_attr(config, "mamba_n_groups", "n_groups")),
            conv_kernel=int(first_attr(config, "mamba_d_conv", "conv_kernel")),
            chunk_size=int(first_attr(config, "mamba_chunk_size", "chunk_size")),
            use_bias=bool(first_attr(config, "use_bias", "mamba_proj_bias", default=False)),
            use_conv_bias=bool(first_attr(config, "mamba_conv_bias", "use_conv_bias", default=True)),
            eps=float(first_attr(config, "layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
            time_step_limit=(float(limit[0]), float(limit[1])),
            activation=str(first_attr(config, "mamba_hidden_act", "hidden_act", default="silu")),
        )
        if dims.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba2 conv activation {dims.activation!r} is not supported (only silu)")
        if dims.num_heads % dims.n_groups:
            raise ValueError(f"num_heads {dims.num_heads} must be a multiple of n_groups {dims.n_groups}")
        return dims


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(a[..., j+1 : i+1])`` for ``j <= i``, else ``-inf`` (masked cumsum: stable)."""
    c = a.shape[-1]
    x = a[..., None].expand(*a.shape, c)
    x = x.masked_fill(~torch.tril(torch.ones(c, c, dtype=torch.bool, device=a.device), -1), 0)
    x = x.cumsum(dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(c, c, dtype=torch.bool, device=a.device)), -torch.inf)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    layout: ChunkLayout,
    initial_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD chunked scan over the prefill requests of ``layout``, without the D skip.

    Args (flat over all tokens of the batch; only ``layout.token_src`` rows are read):
        x ``[T, H, P]``, dt ``[T, H]`` (after softplus and clamp), A ``[H]`` (negative), B/C ``[T, G, N]``
        (head ``h`` reads group ``h // (H / G)``), initial_states ``[num_prefill, H, P, N]``.
    Returns:
        y ``[len(token_src), H, P]`` and boundary states ``[num_prefill, max_chunks + 1, H, P, N]``:
        ``[:, 0]`` the initial state, ``[:, j + 1]`` the state after the request's chunk ``j``.
    """
    num_heads, head_dim = x.shape[1:]
    groups, state_size = B.shape[1:]
    xc, dtc, Bc, Cc = (layout.to_chunks(t) for t in (x, dt, B, C))
    n, c = dtc.shape[:2]
    per_group = (n, groups, num_heads // groups)  # heads split as [group, head-in-group]
    a = (dtc * A).transpose(1, 2)  # [n, H, c]: log-decay of each step; 0 on identity tokens
    a_cum = a.cumsum(dim=-1)
    x_dt = (xc * dtc[..., None]).view(n, c, *per_group[1:], head_dim)
    # Within a chunk: y_l = sum_{s<=l} (C_l . B_s) exp(a_cum_l - a_cum_s) dt_s x_s. C . B is per group,
    # so it is computed once per group, not per head.
    scores = torch.einsum("nlgd,nsgd->ngls", Cc, Bc)[:, :, None] * torch.exp(segment_sum(a)).view(
        *per_group, c, c
    )
    y = torch.einsum("ngjls,nsgjp->nlgjp", scores, x_dt)
    # Each chunk's own contribution to the state at its end, and its total decay.
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum).view(*per_group, c).permute(0, 3, 1, 2)
    chunk_states = torch.einsum("nlgjp,nlgd->ngjpd", x_dt * decay_to_end[..., None], Bc)
    chunk_states = chunk_states.reshape(n, num_heads, head_dim, state_size)
    chunk_decay = torch.exp(a_cum[..., -1])
    boundary = _carry_across_chunks(chunk_states, chunk_decay, layout.chunk_table, initial_states)
    # Across chunks: y_l += exp(a_cum_l) C_l . h_start.
    start = layout.chunk_start_states(boundary).view(*per_group, head_dim, state_size)
    decay_in = torch.exp(a_cum).view(*per_group, c).permute(0, 3, 1, 2)[..., None]
    y = y + torch.einsum("nlgd,ngjpd->nlgjp", Cc, start) * decay_in
    return layout.from_chunks(y.reshape(n, c, num_heads, head_dim)), boundary


def _carry_across_chunks(
    chunk_states: torch.Tensor, chunk_decay: torch.Tensor, table: torch.Tensor, initial: torch.Tensor
) -> torch.Tensor:
    """Sequential pass ``h <- decay_j h + s_j`` over each request's chunks (identity chunk past its end)."""
    state = initial
    out = [initial]
    for j in range(table.shape[1]):
        ids = table[:, j]
        state = state * chunk_decay[ids][:, :, None, None] + chunk_states[ids]
        out.append(state)
    return torch.stack(out, dim=1)


def ssd_recurrent_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: state ``[R, H, P, N]``, x ``[R, H, P]``, dt ``[R, H]``, B/C ``[R, H, N]``.
    Returns ``(y [R, H, P] without the D skip, new state)``."""
    decay = torch.exp(dt * A)[:, :, None, None]
    state = state * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return torch.einsum("rhpn,rhn->rhp", state, C), state


class Mamba2Mixer(RecurrentLayer):
    """The Mamba2 mixer; parameter names and shapes equal transformers' (``in_proj.weight``,
    ``conv1d.weight`` ``[conv_dim, 1, K]``, ``conv1d.bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``,
    ``out_proj.weight``), so ``load_weights`` takes checkpoint names with the layer prefix stripped."""

    dims_type = Mamba2Dims

    def __init__(self, config: object, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        d = self.dims_of(config)
        self.dims = d
        proj_size = 2 * d.intermediate_size + 2 * d.n_groups * d.state_size + d.num_heads
        self.in_proj = WeightHolder(
            (proj_size, d.hidden_size), proj_size if d.use_bias else None, params_dtype
        )
        self.conv1d = WeightHolder(
            (d.conv_dim, 1, d.conv_kernel), d.conv_dim if d.use_conv_bias else None, params_dtype
        )
        self.dt_bias = make_param(d.num_heads, dtype=params_dtype)
        self.A_log = make_param(d.num_heads, dtype=params_dtype)
        self.D = make_param(d.num_heads, dtype=params_dtype)
        self.norm = WeightHolder((d.intermediate_size,), None, params_dtype)
        self.out_proj = WeightHolder(
            (d.hidden_size, d.intermediate_size), d.hidden_size if d.use_bias else None, params_dtype
        )

    @staticmethod
    def _state_shapes(d: Mamba2Dims) -> tuple[tuple[int, ...], ...]:
        """``((K - 1, conv_dim), (num_heads, head_dim, state_size))``."""
        return ((d.conv_kernel - 1, d.conv_dim), (d.num_heads, d.head_dim, d.state_size))

    def _run(
        self,
        hidden_states: torch.Tensor,
        batch: RecurrentBatch,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        checkpoint_every: int | None,
    ) -> tuple[torch.Tensor, StateCheckpoints | None]:
        d = self.dims
        num_tokens = hidden_states.shape[0]
        if num_tokens != batch.num_tokens:
            raise ValueError(f"hidden_states has {num_tokens} tokens, the batch {batch.num_tokens}")
        proj = F.linear(hidden_states, self.in_proj.weight, self.in_proj.bias)
        gate, xbc, dt = proj.split([d.intermediate_size, d.conv_dim, d.num_heads], dim=-1)
        positions = batch.snapshot_positions(checkpoint_every)
        xbc, conv_snaps = causal_conv1d_varlen(
            xbc, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state, batch, positions
        )
        group_dim = d.n_groups * d.state_size
        x, B, C = xbc.split([d.intermediate_size, group_dim, group_dim], dim=-1)
        x = x.reshape(num_tokens, d.num_heads, d.head_dim)
        B = B.reshape(num_tokens, d.n_groups, d.state_size)
        C = C.reshape(num_tokens, d.n_groups, d.state_size)
        per_group = d.num_heads // d.n_groups
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*d.time_step_limit)
        A = -torch.exp(self.A_log.float())

        y = torch.zeros_like(x, dtype=torch.float32)

        def step(state: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            B_t, C_t = (t[tok].float().repeat_interleave(per_group, dim=1) for t in (B, C))
            return ssd_recurrent_step(state, x[tok].float(), dt[tok], A, B_t, C_t)

        def scan(layout: ChunkLayout, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return ssd_chunk_scan(x, dt, A, B, C, layout, initial)

        chunk = min(d.chunk_size, SCAN_CHUNK_CAP)
        states = advance_states(batch, ssm_state, y, chunk, checkpoint_every, step, scan)
        y = y + self.D.float()[:, None] * x
        y = self.gate_and_norm(y.reshape(num_tokens, d.intermediate_size), gate)
        out = F.linear(y.to(hidden_states.dtype), self.out_proj.weight, self.out_proj.bias)
        if positions is None:
            return out, None
        return out, make_checkpoints(batch, positions, conv_snaps, states)

    def gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The scan output ``[T, intermediate]`` gated and normed, float32; Falcon-H1 overrides it."""
        d = self.dims
        return gated_rms_norm(y, gate, self.norm.weight, d.intermediate_size // d.n_groups, d.eps)


def gated_rms_norm(
    y: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    group: int,
    eps: float,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """``weight * rmsnorm_per_group(y * silu(gate))`` in float32 (norm after gate, as Mamba2 does), or with
    ``norm_before_gate`` ``weight * rmsnorm_per_group(y) * silu(gate)``."""
    y = y.float()
    if not norm_before_gate:
        y = y * F.silu(gate.float())
    g = y.reshape(*y.shape[:-1], -1, group)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    out = weight.float() * g.reshape(y.shape)
    return out * F.silu(gate.float()) if norm_before_gate else out
