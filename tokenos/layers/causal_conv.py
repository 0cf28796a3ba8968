"""The depthwise causal conv of the recurrent layers, with a ROLLING state: the last ``K - 1`` inputs.

Each request's rows are laid out as ``[state ; new inputs]`` in one buffer, so the conv of any split of a
sequence equals the conv of the whole sequence, and the state after any prefix is a slice of that buffer.
A step where every request brings one token takes a cheaper path (one window per request).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenos.layers.recurrent_batch import RecurrentBatch


def _conv1d_one_token(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    batch: RecurrentBatch,
) -> torch.Tensor:
    """``causal_conv1d_varlen`` when every request brings exactly one token (x row r is request r)."""
    window = torch.cat([batch.read_states(conv_state), x.float()[:, None]], dim=1)  # [R, K, C]
    out = (window * weight.float().T).sum(dim=1)
    if bias is not None:
        out = out + bias.float()
    batch.write_states(conv_state, batch.decode_reqs, window[:, 1:])
    if x.dtype != torch.float32:
        out = out.to(x.dtype).float()  # round before the activation, as in the general path
    return F.silu(out)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    batch: RecurrentBatch,
    snapshots: list[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv1d + SiLU over a varlen batch with a rolling state, updated in place.

    Args:
        x: ``[num_tokens, channels]`` conv inputs.
        weight: ``[channels, K]`` (the HF ``conv1d.weight`` squeezed).
        conv_state: ``[num_reqs or num_slots, K - 1, channels]``: the last ``K - 1`` inputs before the step.
        snapshots: optional ``(request, n)`` pairs; returns the conv state after the first ``n`` new tokens.
    Returns:
        ``(silu(conv(x)) [num_tokens, channels] float32, snapshot states [M, K - 1, channels] or None)``.
    """
    k = weight.shape[1]
    k1 = k - 1
    if batch.all_decode and snapshots is None and k1 > 0:
        return _conv1d_one_token(x, weight, bias, conv_state, batch), None
    token_rows, state_start = batch.conv_rows(k)
    channels = x.shape[1]
    ext = x.new_empty((batch.num_tokens + batch.num_reqs * k1, channels), dtype=torch.float32)
    window = torch.arange(k1, device=x.device)
    if k1 > 0:
        ext[(state_start[:, None] + window).reshape(-1)] = batch.read_states(conv_state).reshape(-1, channels)
    ext[token_rows] = x.float()
    # out[t] = sum_j w[:, j] * input[t - (K-1) + j]; K is tiny, so K gathers beat materializing windows.
    w = weight.float()
    out = ext[token_rows - k1] * w[:, 0]
    for j in range(1, k):
        out = out + ext[token_rows - k1 + j] * w[:, j]
    if bias is not None:
        out = out + bias.float()
    lengths = torch.tensor(batch.lengths, dtype=torch.long, device=x.device)
    new_state = ext[state_start[:, None] + lengths[:, None] + window]
    done = [r for r, n in enumerate(batch.lengths) if n > 0]
    if done:
        batch.write_states(conv_state, done, new_state[done])
    snap = None
    if snapshots is not None:
        reqs = torch.tensor([r for r, _ in snapshots], dtype=torch.long, device=x.device)
        offs = torch.tensor([n for _, n in snapshots], dtype=torch.long, device=x.device)
        snap = ext[state_start[reqs][:, None] + offs[:, None] + window]
    if x.dtype != torch.float32:
        # A low-precision conv rounds its output before the activation (transformers and the
        # causal-conv1d kernels do): round here too, so bf16 states match the reference's.
        out = out.to(x.dtype).float()
    return F.silu(out), snap
