"""`RecurrentLayer`: the base of every layer whose requests each own a (conv state, recurrent state) pair.

A recurrent layer is a cache layer (see `tokenos.layers.metadata`): its pool entry is ``[conv_pool,
state_pool]``, its KV-cache spec a `MambaSpec` of those two shapes, and each step it advances every
scheduled request's state in place, in the page the `RecurrentBatch` names. Subclasses (Mamba2 mixer,
gated DeltaNet) give their dims and state shapes and implement ``_run``; ``advance`` is the same step on
explicit state tensors (what the layer tests drive).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from tokenos.core.kv_cache.spec import MambaSpec
from tokenos.layers.metadata import CacheLayer, ForwardBatch
from tokenos.layers.recurrent_batch import RecurrentBatch, StateCheckpoints
from tokenos.layers.weights import load_named_weights

if TYPE_CHECKING:
    from tokenos.config import CacheConfig


def first_attr(config: object, *names: str, default: object = None) -> object:
    """The first attribute of ``config`` among ``names`` that is set (families name the same thing apart)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"config has none of {names}")
    return default


class RecurrentLayer(CacheLayer):
    """Subclasses set ``dims_type`` (a dims dataclass with ``from_config``) and ``dims``, and implement
    ``_state_shapes(dims)`` and ``_run(hidden_states, batch, conv_state, recurrent_state,
    checkpoint_every)``, which returns the output and, when ``checkpoint_every`` is set, the checkpoints.
    """

    dims_type: type
    dims: object

    @classmethod
    def dims_of(cls, config: object) -> object:
        """``config`` itself if it is already the layer's dims, else its dims read from an HF config."""
        return config if isinstance(config, cls.dims_type) else cls.dims_type.from_config(config)

    @classmethod
    def state_shapes(
        cls, config: object, dtype: str = "float32", recurrent_dtype: str | None = None
    ) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
        """Per-request ``(conv state shape, recurrent state shape)`` and their dtypes."""
        return cls._state_shapes(cls.dims_of(config)), (dtype, recurrent_dtype or dtype)

    def get_kv_cache_spec(self, cache_config: CacheConfig, dtype: str) -> MambaSpec:
        # The conv state is kept in the model dtype; the recurrent state in float32, since it
        # accumulates over the whole sequence (that is what the layers are tested for).
        shapes, dtypes = self.state_shapes(self.dims, dtype, "float32")
        return MambaSpec(
            shapes, dtypes, block_size=cache_config.block_size, cache_mode=cache_config.mamba_cache_mode
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors named relative to this layer (``in_proj.weight`` ...)."""
        return set(load_named_weights(self, weights))

    def forward(self, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``, advancing this layer's pool entry in place;
        in "all" mode the states at the step's block boundaries are written to their checkpoint pages too,
        and the states after every position of a request verifying drafts are kept on the batch."""
        (conv, state), rbatch = self.cache_entry(batch)
        if rbatch.checkpoint_every is None and not rbatch.verify_reqs:
            return self.advance(hidden_states, rbatch, conv, state)
        out, snaps = self._run(hidden_states, rbatch, conv, state, rbatch.checkpoint_every)
        assert snaps is not None
        num = 0 if rbatch.checkpoint_pages is None else len(rbatch.checkpoint_pages)
        if num:
            conv.index_copy_(0, rbatch.checkpoint_pages, snaps.conv_states[:num].to(conv.dtype))
            state.index_copy_(0, rbatch.checkpoint_pages, snaps.recurrent_states[:num].to(state.dtype))
        if rbatch.verify_reqs:
            rbatch.keep_verified(conv, state, snaps.conv_states[num:], snaps.recurrent_states[num:])
        return out

    def advance(
        self,
        hidden_states: torch.Tensor,
        batch: RecurrentBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden_states [num_tokens, hidden]`` -> ``[num_tokens, hidden]``; states advanced in place."""
        out, _ = self._run(hidden_states, batch, conv_state, recurrent_state, checkpoint_every=None)
        return out

    def advance_with_checkpoints(
        self,
        hidden_states: torch.Tensor,
        batch: RecurrentBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        checkpoint_every: int,
    ) -> tuple[torch.Tensor, StateCheckpoints]:
        """Like ``advance``, and also return the states after every absolute multiple of
        ``checkpoint_every`` tokens reached in this step (``batch.num_computed_tokens`` required)."""
        out, ckpt = self._run(hidden_states, batch, conv_state, recurrent_state, checkpoint_every)
        assert ckpt is not None
        return out, ckpt

    def _run(
        self,
        hidden_states: torch.Tensor,
        batch: RecurrentBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        checkpoint_every: int | None,
    ) -> tuple[torch.Tensor, StateCheckpoints | None]:
        raise NotImplementedError

    @staticmethod
    def _state_shapes(dims: object) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError
